"""The simulator on plans with virtual stages: bubbles against the papers' closed forms, replicas,
and `hybridpipe simulate` / `hybridpipe schedule --png` on a virtual plan."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.simtrace import chrome_trace, shade
from hybridpipe.pipeline.simulator import StageCosts, bubble_fraction, simulate, simulate_topology
from tests.pipeline.test_virtual_format import plan_for, virtual_topology


@pytest.mark.parametrize(("p", "M", "V"), list(itertools.product([2, 4, 8], [8, 16], [1, 2, 4])))
def test_interleaving_divides_the_bubble_by_the_chunks(p, M, V):
    """Megatron (Narayanan et al. 2021, section 2.2.1): with V chunks of forward f/V and backward
    b/V the fill and drain take (p-1)(f+b)/V, so a step takes (M + (p-1)/V)(f+b) and the bubble
    fraction (idle over all time) is (p-1)/(VM + p-1) -- the (p-1)/(M+p-1) of 1F1B divided by V
    as M grows (Megatron's (p-1)/(VM) is the idle time over the busy time)."""
    f = b = 1.0
    res = simulate_topology(virtual_topology("interleaved-1f1b", [1] * p, V, M), get_schedule("interleaved-1f1b"),
                            [StageCosts(f / V, b / V, 0.0, 0, ()) for _ in range(p * V)])
    assert bubble_fraction(res) == pytest.approx((p - 1) / (V * M + p - 1), rel=0.05)
    assert res.step_ms == pytest.approx((M + (p - 1) / V) * (f + b), rel=1e-9)
    if V == 1:
        assert bubble_fraction(res) == pytest.approx((p - 1) / (M + p - 1), rel=1e-9)


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_idles_only_while_the_pipeline_starts(p):
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): with F = B = W per
    chunk and M >= 2p - 1 micro-batches its only bubble is the start-up, (p-1) F, so one step takes
    6 M F + (p-1) F and the bubble fraction is (p-1)/(6M + p-1): zb-h1 on the same two-chunk stages
    idles (p-1)(F+B-W) of a whole stage = 2 (p-1) F, twice as long."""
    F = 1.0
    for M in range(2 * p - 1, 17):
        topo = virtual_topology("zbv", [1] * p, 2, M)
        one = simulate_topology(topo, get_schedule("zbv"), [StageCosts(F, 2 * F, 0.0, 0, ()) for _ in range(2 * p)],
                                steps=1)
        assert one.step_ms == pytest.approx(6 * M * F + (p - 1) * F, rel=1e-9)
        assert bubble_fraction(one) == pytest.approx((p - 1) / (6 * M + p - 1), rel=0.05)
        zb = simulate_topology(Topology(tuple((s,) for s in range(p)), M), get_schedule("zb-h1"),
                               [StageCosts(2 * F, 4 * F, 0.0, 0, ()) for _ in range(p)], steps=1)
        assert zb.step_ms - 6 * M * F == pytest.approx(2 * (one.step_ms - 6 * M * F), rel=0.05)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_replicas_split_the_micro_batches_of_every_chunk(schedule):
    """Two replicas per group halve the step; unequal groups still run (slowest group bounds it)."""
    costs = [StageCosts(1.0, 2.0, 0.0, 0, ()) for _ in range(6)]
    one = simulate_topology(virtual_topology(schedule, [1, 1, 1], 2, 12), get_schedule(schedule), costs)
    two = simulate_topology(virtual_topology(schedule, [2, 2, 2], 2, 12), get_schedule(schedule), costs)
    assert two.step_ms == pytest.approx(one.step_ms / 2, rel=0.15)
    mixed = simulate_topology(virtual_topology(schedule, [2, 1, 2], 2, 12), get_schedule(schedule), costs)
    assert 12 * 2 * 3.0 <= mixed.step_ms < one.step_ms * 1.5


def test_transfers_on_a_shared_link_are_priced_per_chunk():
    """Group p-1 sends group 0 the activations of stage p-1 and gradients of stage p: both on one link."""
    topo = virtual_topology("interleaved-1f1b", [1, 1], 2, 4)
    free = simulate_topology(topo, get_schedule("interleaved-1f1b"), [StageCosts(1.0, 2.0, 0.0, 0, ())] * 4)
    slow = simulate_topology(topo, get_schedule("interleaved-1f1b"), [StageCosts(1.0, 2.0, 0.5, 0, ())] * 4)
    links = {iv.where for iv in slow.intervals if iv.kind in ("act", "grad")}
    assert links == {"link 0->1", "link 1->0"} and slow.step_ms > free.step_ms
    assert {iv.stage for iv in slow.intervals if iv.where == "link 1->0"} == {1, 3}


@pytest.fixture()
def virtual_plan_file(tmp_path):
    topo = virtual_topology("interleaved-1f1b", [1, 2], 2, 4)
    plan = plan_for(topo, "interleaved-1f1b", 2)
    stages = tuple(dataclasses.replace(s, forward_ms=1.0, backward_ms=2.0, compute_ms=3.0, send_ms=0.1)
                   for s in plan.stages)
    return save_plan(dataclasses.replace(plan, stages=stages), tmp_path / "plan.json")


def test_simulate_and_schedule_draw_a_virtual_plan(virtual_plan_file, tmp_path, capsys):
    trace, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", str(virtual_plan_file), "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "schedule interleaved-1f1b" in out and "predicted step time:" in out and png.stat().st_size > 1000
    names = [e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0: stages 0, 2 replica 0", "rank 1: stages 1, 3 replica 0", "rank 2: stages 1, 3 replica 1"]
    assert main(["schedule", str(virtual_plan_file), "--png", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "rank 1 (stages 1, 3, replica 0)" in out and "F0:s1" in out and "F0:s3" in out
    assert "2 model chunks per rank" in out and (tmp_path / "s.png").stat().st_size > 1000
    assert main(["simulate", str(virtual_plan_file), "--schedule", "1f1b"]) == 2
    assert "1f1b runs 1 (no virtual stages) model chunks per rank, not 2" in capsys.readouterr().err


def test_later_chunks_are_drawn_lighter():
    assert shade("#4C72B0", 0, 2) == "#4C72B0" != shade("#4C72B0", 1, 2)
    assert shade("#4C72B0", 0, 1) == "#4C72B0"
    topo = virtual_topology("zbv", [1, 1], 2, 3)
    plan = plan_for(topo, "zbv", 2)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, forward_ms=1.0, backward_ms=2.0)
                                                  for s in plan.stages))
    events = chrome_trace(simulate(plan, steps=1), topo)["traceEvents"]
    assert {e["args"]["stage"] for e in events if e.get("cat") == "W" and e["pid"] == 0} == {0, 3}
