"""Schedules: every rank's list is consistent with every other's (validated symbolically)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.instructions import (
    Backward,
    Forward,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
    SyncWait,
)
from hybridpipe.pipeline.schedules import Topology, all_programs, check_schedulable, rank_program
from hybridpipe.pipeline.validate import ScheduleError, in_transit, validate


def topology(replicas: list[int], micro_batches: int) -> Topology:
    ranks, r = [], 0
    for n in replicas:
        ranks.append(tuple(range(r, r + n)))
        r += n
    return Topology(tuple(ranks), micro_batches)


def run_steps(topo: Topology, schedule: str, steps: int, drains=()) -> list[dict]:
    out, phase = [], 0
    for k in range(steps):
        drain = k == steps - 1 or k in drains
        out.append(all_programs(topo, get_schedule(schedule), phase=phase, drain=drain))
        phase = 0 if drain else phase + 1
    return out


shapes = st.lists(st.sampled_from([1, 1, 1, 2, 3, 4]), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(replicas=shapes, extra=st.integers(0, 12), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_flushed_schedules_are_valid_and_match_sgd(replicas, extra, schedule):
    M = min(16, max(replicas) + extra)
    topo = topology(replicas, M)
    report = validate(topo, run_steps(topo, schedule, 2))
    for s, ranks in enumerate(topo.stage_ranks):
        # every micro-batch of both steps goes through every stage once, on its replica
        assert sorted(g for r in ranks for g in report.forwards[r]) == list(range(2 * M))
        for j, r in enumerate(ranks):
            mine = [m for m in range(M) if m % len(ranks) == j]
            assert report.steps[r] == [1 / M, 1 / M]            # one step per step, grads x 1/M (flush)
            if schedule == "1f1b":
                assert report.max_in_flight[r] == min(topo.warm(s), len(mine))
            else:
                assert report.max_in_flight[r] == len(mine)


@settings(max_examples=150, deadline=None)
@given(replicas=shapes, rounds=st.integers(1, 3), steps=st.integers(1, 4), drain_at=st.sets(st.integers(0, 3)))
def test_pipedream_is_valid_across_steps_and_drains(replicas, rounds, steps, drain_at):
    M = math.lcm(*replicas) * rounds
    if M > 16:
        M = math.lcm(*replicas)
    topo = topology(replicas, M)
    report = validate(topo, run_steps(topo, "pipedream", steps, drains=drain_at))
    for s, ranks in enumerate(topo.stage_ranks):
        r_s = len(ranks)
        for r in ranks:
            assert report.max_in_flight[r] <= topo.warm(s)
            # an update after every backward, each a round of r_s micro-batches
            assert report.steps[r] == [1 / r_s] * (steps * M // r_s)
            assert report.forwards[r] == sorted(report.forwards[r])


def test_1f1b_unreplicated_is_the_textbook_schedule():
    """Stage s of S runs S - s forwards, then B(i) F(i + S - s), then drains (Narayanan et al.)."""
    S, M = 4, 8
    topo = topology([1] * S, M)
    for s in range(S):
        ops = [(type(i).__name__[0], i.micro_batch) for i in rank_program(topo, s, get_schedule("1f1b"))
               if isinstance(i, (Forward, Backward))]
        w = S - s
        expected = [("F", m) for m in range(w)]
        for m in range(M):
            expected.append(("B", m))
            if m + w < M:
                expected.append(("F", m + w))
        assert ops == expected


def test_pipedream_steady_state_carries_exactly_the_in_flight_micro_batches():
    topo = topology([1, 2, 1], 4)
    steady = rank_program(topo, 0, get_schedule("pipedream"), phase=5, drain=False)
    owed = [i.micro_batch for i in steady if isinstance(i, Backward) and i.micro_batch < 0]
    assert owed == [-3, -2, -1]                                  # warm(0) = 4 in flight, one finished this step
    assert rank_program(topo, 0, get_schedule("pipedream"), phase=9, drain=False) == steady


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_validator_catches_every_dropped_or_misrouted_message(schedule):
    topo = topology([1, 2, 1], 4)
    steps = run_steps(topo, schedule, 1)
    validate(topo, steps)
    for rank, prog in steps[0].items():
        for i, ins in enumerate(prog):
            if isinstance(ins, (SendActivations, SendGradients, RecvActivations, RecvGradients, SyncWait)):
                broken = {**steps[0], rank: prog[:i] + prog[i + 1:]}
                with pytest.raises(ScheduleError):
                    validate(topo, [broken])
            if isinstance(ins, (SendActivations, RecvGradients)):
                wrong = dataclasses.replace(ins, peer=(ins.peer + 1) % topo.world_size)
                with pytest.raises(ScheduleError):
                    validate(topo, [{**steps[0], rank: prog[:i] + [wrong] + prog[i + 1:]}])


def test_validator_reports_a_cycle_of_waits():
    topo = topology([1, 1], 1)
    progs = all_programs(topo, get_schedule("1f1b"))
    # stage 0 waits for the gradient before sending the activation it depends on
    p0 = progs[0]
    send = next(i for i, x in enumerate(p0) if isinstance(x, SendActivations))
    recv = next(i for i, x in enumerate(p0) if isinstance(x, RecvGradients))
    swapped = p0[:send] + [p0[recv], p0[send]] + p0[recv + 1:]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(topo, [{0: swapped, 1: progs[1]}])
    # a step on one replica only makes the replicas disagree
    topo2 = topology([2], 2)
    progs2 = all_programs(topo2, get_schedule("gpipe"))
    with pytest.raises(ScheduleError, match="disagree"):
        validate(topo2, [{0: progs2[0] + [Step(0.5)], 1: progs2[1]}])


def test_unschedulable_requests_are_refused_clearly():
    with pytest.raises(UserError, match="use --micro-batches >= 3"):
        check_schedulable(topology([1, 3], 2), get_schedule("1f1b"))
    with pytest.raises(UserError, match="^1 micro-batch per step leaves replicas of a 2-replica stage idle"):
        check_schedulable(topology([2], 1), get_schedule("1f1b"))
    with pytest.raises(UserError, match="multiple of every stage's replica count"):
        check_schedulable(topology([2, 3], 4), get_schedule("pipedream"))
    with pytest.raises(UserError, match="unknown schedule"):
        check_schedulable(topology([1], 1), get_schedule("zigzag"))
    with pytest.raises(UserError, match="rank 9 has no stage"):
        rank_program(topology([1, 1], 2), 9, get_schedule("gpipe"))


@settings(max_examples=60, deadline=None)
@given(replicas=shapes, phase=st.integers(0, 5))
def test_in_transit_is_what_was_sent_before_and_is_received_after_a_step_boundary(replicas, phase):
    M = math.lcm(*replicas)
    topo = topology(replicas, M)
    progs = [all_programs(topo, get_schedule("pipedream"), phase=k, drain=False) for k in range(phase + 2)]
    sent = {(r, ins.peer, g) for k in range(phase + 1) for r, prog in progs[k].items() for ins in prog
            if isinstance(ins, SendGradients) for g in [k * M + ins.micro_batch]}
    later = {(ins.peer, r, (phase + 1) * M + ins.micro_batch) for r, prog in progs[phase + 1].items()
             for ins in prog if isinstance(ins, RecvGradients)}
    expected = sent & later
    got = {(src, dst, (phase + 1) * M + m) for dst, msgs in in_transit(topo, get_schedule("pipedream"), phase).items()
           for src, kind, m in msgs if kind == "grad"}
    assert got == expected
    assert all(kind == "grad" for msgs in in_transit(topo, get_schedule("pipedream"), phase).values()
               for _, kind, _ in msgs)
    assert all(not msgs for msgs in in_transit(topo, get_schedule("1f1b"), phase).values())
