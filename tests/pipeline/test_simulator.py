"""The schedule simulator against closed forms it must reproduce exactly."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline import simulator
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.simtrace import chrome_trace, draw_timeline
from hybridpipe.pipeline.simulator import (
    StageCosts,
    closed_form_ms,
    simulate,
    simulate_topology,
    stage_busy_ms,
    step_programs,
)
from tests.pipeline.harness import make_plan
from tests.pipeline.test_virtual_format import virtual_topology


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


# shapes of every schedule (replicas, virtual stages) and costs that differ per draw: the virtual-chunk search
# simulates many plans of one shape, differing only in costs
SHAPES = [("gpipe", chain(3, 4)), ("1f1b", Topology(((0, 1), (2,), (3, 4)), 6)), ("pipedream", chain(3, 3)),
          ("zb-h1", Topology(((0,), (1, 2)), 4)),
          ("interleaved-1f1b", virtual_topology("interleaved-1f1b", [2, 1], 2, 4)),
          ("zbv", virtual_topology("zbv", [1, 2], 2, 4))]


def random_costs(rng: random.Random, n: int) -> list[StageCosts]:
    return [StageCosts(rng.uniform(0.5, 3), rng.uniform(1, 6), rng.choice([0.0, rng.uniform(0.1, 2)]), 0,
                       tuple(rng.uniform(0.1, 1.5) for _ in range(rng.randint(1, 3))),
                       input_share=rng.uniform(0.2, 0.8), sharded=rng.random() < 0.5, lost_ms=rng.choice([0.0, 0.3]))
            for _ in range(n)]


@pytest.mark.parametrize("schedule,topo", SHAPES, ids=[s for s, _ in SHAPES])
def test_cached_instruction_lists_give_the_same_simulation(schedule, topo):
    """Several cost draws of one shape, each simulated from freshly built lists (cache cleared) and again
    from the cached ones: the same result to the bit (step times, step ends, utilisation, every interval)."""
    rng = random.Random(schedule)
    draws = [random_costs(rng, topo.n_stages) for _ in range(4)]
    cold = []
    for costs in draws:
        step_programs.cache_clear()
        cold.append(simulate_topology(topo, get_schedule(schedule), costs))
    warm = [simulate_topology(topo, get_schedule(schedule), costs) for costs in draws]
    assert step_programs.cache_info().hits >= len(draws)
    assert warm == cold
    assert len({r.step_ms for r in cold}) > 1          # the draws differ: the lists are all they share


def test_plans_of_one_shape_build_the_instruction_lists_once(monkeypatch):
    """Two plans differing only in their stages' costs: the schedule's lists are built for the first
    (one all_programs call per simulated step) and reused for the second."""
    built = []
    real = simulator.all_programs

    def counting(*args, **kwargs):
        built.append(kwargs["phase"])
        return real(*args, **kwargs)
    monkeypatch.setattr(simulator, "all_programs", counting)
    step_programs.cache_clear()
    one = make_plan("mlp", [2, 5], [1, 2, 1], micro_batches=4, times=[(1.0, 2.0), (2.0, 4.0), (1.0, 2.0)])
    two = dataclasses.replace(one, stages=tuple(dataclasses.replace(s, forward_ms=3 * s.forward_ms)
                                                for s in one.stages))
    a, b = simulate(one), simulate(two)
    assert built == list(range(a.steps)) and b.steps == a.steps
    assert b.step_ms > a.step_ms
    assert step_programs.cache_info().misses == 1 and step_programs.cache_info().hits == 1
