"""The schedule simulator against closed forms it must reproduce exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.simtrace import chrome_trace, draw_timeline
from hybridpipe.pipeline.simulator import StageCosts, closed_form_ms, simulate, simulate_topology, stage_busy_ms
from tests.pipeline.harness import make_plan


def chain(S: int, M: int) -> Topology:
    return Topology(tuple((s,) for s in range(S)), M)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_one_stage_takes_its_compute(schedule, M):
    res = simulate_topology(chain(1, M), get_schedule(schedule), [StageCosts(1.5, 2.5, 0, 0, ())])
    assert res.step_ms == pytest.approx(M * 4.0)
    assert res.utilisation == [pytest.approx(1.0)]


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 8), M=st.integers(1, 16), f=st.floats(0.1, 5), b=st.floats(0.1, 10),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_balanced_flushed_pipeline_matches_closed_form(S, M, f, b, schedule):
    res = simulate_topology(chain(S, M), get_schedule(schedule), [StageCosts(f, b, 0, 0, ())] * S, steps=3)
    assert res.step_ms == pytest.approx(closed_form_ms(M, S, f, b), rel=1e-9)
    assert all(u == pytest.approx(M / (M + S - 1)) for u in res.utilisation)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 6), M=st.integers(1, 8), c=st.floats(0.01, 1.0))
def test_gpipe_pays_each_cut_twice_on_its_critical_path(S, M, c):
    f, b = 1.0, 2.0       # transfers shorter than compute: the links never queue
    res = simulate_topology(chain(S, M), get_schedule("gpipe"), [StageCosts(f, b, c, 0, ())] * S)
    assert res.step_ms == pytest.approx(closed_form_ms(M, S, f, b) + 2 * (S - 1) * c)


@pytest.mark.parametrize("S,M", [(2, 4), (4, 4), (4, 1), (3, 6)])
def test_pipedream_has_no_bubble_in_steady_state(S, M):
    res = simulate_topology(chain(S, M), get_schedule("pipedream"), [StageCosts(1.0, 2.0, 0, 0, ())] * S)
    assert res.step_ms == pytest.approx(M * 3.0)
    assert all(u == pytest.approx(1.0) for u in res.utilisation)
    flushed = simulate_topology(chain(S, M), get_schedule("1f1b"), [StageCosts(1.0, 2.0, 0, 0, ())] * S)
    assert flushed.step_ms == pytest.approx(closed_form_ms(M, S, 1.0, 2.0))


def test_allreduce_hides_behind_the_backward_when_it_is_short_enough():
    M, f, b, layers = 2, 1.0, 4.0, 4          # two replicas, one micro-batch each
    topo = Topology(((0, 1),), M)
    short = simulate_topology(topo, get_schedule("1f1b"), [StageCosts(f, b, 0, 0, (0.5,) * layers)])
    assert short.step_ms == pytest.approx(f + b + 0.5)          # only the last layer's all-reduce shows
    long = simulate_topology(topo, get_schedule("1f1b"), [StageCosts(f, b, 0, 0, (3.0,) * layers)])
    assert long.step_ms == pytest.approx(f + b / layers + layers * 3.0)   # the chain from the first ready grad
    lump = simulate_topology(topo, get_schedule("1f1b"), [StageCosts(f, b, 0, 0, (2.0,))])
    assert lump.step_ms == pytest.approx(f + b + 2.0)           # one all-reduce after the backward


def test_replicas_split_the_micro_batches():
    res = simulate_topology(Topology(((0, 1, 2),), 6), get_schedule("gpipe"), [StageCosts(1.0, 2.0, 0, 0, ())])
    assert res.step_ms == pytest.approx(2 * 3.0)
    assert stage_busy_ms(res, [0]) == pytest.approx(res.steps * 2 * 3.0)   # 2 micro-batches per simulated step


def test_plan_times_and_chrome_trace(tmp_path):
    plan = make_plan("mlp", [2, 5], [1, 2, 1], schedule="1f1b", micro_batches=4,
                     times=[(1.0, 2.0), (2.0, 4.0), (1.0, 2.0)], send_ms=0.25)
    res = simulate(plan)
    assert res.step_ms > closed_form_ms(4, 3, 1.0, 2.0) * 0.5
    trace = json.loads(json.dumps(chrome_trace(res, Topology.from_plan(plan))))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    fwd = [e for e in spans if e["cat"] == "F" and e["pid"] == 1]
    assert fwd and all(e["dur"] == pytest.approx(2000.0) for e in fwd)       # 2 ms in microseconds
    assert any(e["cat"] == "act" for e in spans)
    png = draw_timeline(res, Topology.from_plan(plan), tmp_path / "t.png")
    assert png.stat().st_size > 1000


def test_compute_only_plans_split_forward_and_backward():
    plan = make_plan("mlp", [3], [1, 1], micro_batches=2, times=[(0, 0), (0, 0)])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, compute_ms=3.0) for s in plan.stages))
    assert simulate(plan).step_ms == pytest.approx(closed_form_ms(2, 2, 1.0, 2.0))
