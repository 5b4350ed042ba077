"""One step from a barrier (``simulator.barrier_step_ms``, ``predicted_step_ms``) against a brute-force
longest path over the schedule's ops, hand-worked timelines, and the closed form where it is exact."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.schedule_registry import Schedule, get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate, predict_step_ms
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.simcosts import evaluated_costs
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.simulator import StageCosts, barrier_step_ms, predicted_step_ms, simulate_topology
from tests.partitioner.synth import flat_cluster, make_profile


def longest_path(stage_ranks, M: int, schedule: Schedule, f, b, sync, step) -> float:
    """The step by brute force: each replica runs its ops (the schedule's order) one at a time; F(s, m) waits
    for F(s-1, m), B(s, m) for B(s+1, m); a replicated stage's one all-reduce (``sync[s]``) starts when all
    its replicas' last backwards are done; every rank then steps (``step[s]``); the step ends with the last."""
    S = len(stage_ranks)
    ops = {}
    for s, ranks in enumerate(stage_ranks):
        r, later = len(ranks), sum(len(x) for x in stage_ranks[s:])
        for j in range(r):
            assert schedule.replica_ops is not None
            ops[s, j] = list(schedule.replica_ops([m for m in range(M) if m % r == j], -(-later // r), 0))
    end: dict[tuple[str, int, int], float] = {}
    clock, done = dict.fromkeys(ops, 0.0), dict.fromkeys(ops, 0)
    while any(done[key] < len(seq) for key, seq in ops.items()):
        for (s, j), seq in ops.items():
            while done[s, j] < len(seq):
                op, m = seq[done[s, j]]
                dep = ("F", s - 1, m) if op == "F" and s > 0 else ("B", s + 1, m) if op == "B" and s < S - 1 else None
                if dep is not None and dep not in end:
                    break
                clock[s, j] = end[op, s, m] = max(clock[s, j], end[dep] if dep else 0.0) + (f[s] if op == "F" else b[s])
                done[s, j] += 1
    ends = []
    for s, ranks in enumerate(stage_ranks):
        mine = [clock[s, j] for j in range(len(ranks))]
        synced = max(mine) + sync[s] if len(ranks) > 1 else None
        ends += [(t if synced is None else synced) + step[s] for t in mine]
    return max(ends)


@st.composite
def plans(draw):
    replicas = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    M = draw(st.integers(max(replicas), 8))
    ranks, first = [], 0
    for r in replicas:
        ranks.append(tuple(range(first, first + r)))
        first += r
    times = st.floats(0.1, 10.0)
    n = len(replicas)
    return (tuple(ranks), M, [draw(times) for _ in range(n)], [draw(times) for _ in range(n)],
            [draw(st.floats(0.0, 30.0)) for _ in range(n)], [draw(st.floats(0.0, 5.0)) for _ in range(n)],
            draw(st.sampled_from(["gpipe", "1f1b"])))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_one_step_from_a_barrier_is_the_longest_path_of_the_schedules_ops(plan):
    ranks, M, f, b, sync, step, name = plan
    costs = [StageCosts(f[s], b[s], 0.0, 0, (sync[s],) if len(ranks[s]) > 1 else (), step_ms=step[s])
             for s in range(len(ranks))]
    got = barrier_step_ms(Topology(ranks, M), get_schedule(name), costs)
    assert got == pytest.approx(longest_path(ranks, M, get_schedule(name), f, b, sync, step), rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 5), M=st.integers(1, 8), data=st.data(), name=st.sampled_from(["gpipe", "1f1b"]))
def test_a_chain_without_replicas_steps_from_a_barrier_as_in_its_steady_state(S, M, data, name):
    """A flush ends every step with the first stage's last backward: nothing of the next overlaps it."""
    times = st.floats(0.1, 10.0)
    costs = [StageCosts(data.draw(times), data.draw(times), data.draw(st.floats(0.0, 2.0)), 0, ()) for _ in range(S)]
    topo = Topology(tuple((s,) for s in range(S)), M)
    steady = simulate_topology(topo, get_schedule(name), costs, steps=3).step_ms
    assert barrier_step_ms(topo, get_schedule(name), costs) == pytest.approx(steady, rel=1e-9)


def test_a_replicated_stage_syncs_after_the_later_stage_drains():
    """AlexNet's ``0-15 | 16x2 | 17-21`` in miniature, worked by hand (1F1B, M = 4): stage 1's replicas take
    micro-batches 0, 2 and 1, 3; stage 2 (backward 3) is the slowest, so replica 1's last backward waits for it."""
    ranks = ((0,), (1, 2), (3,))
    costs = [StageCosts(1.0, 1.0, 0.0, 0, ()), StageCosts(1.0, 2.0, 0.0, 0, (10.0,)), StageCosts(1.0, 3.0, 0.0, 0, ())]
    # stage 2: F0 2-3, B0 3-6, F1 6-7, B1 7-10, F2 10-11, B2 11-14, F3 14-15, B3 15-18; stage 1's replica 1
    # (F1 2-3, F3 4-5) runs B1 10-12 and B3 18-20: the all-reduce runs 20-30
    assert barrier_step_ms(Topology(ranks, 4), get_schedule("1f1b"), costs) == pytest.approx(30.0)


def test_compute_lost_beside_the_sync_slows_what_computes_beside_it():
    """Stage 0 (backward 10) drains long after stage 1's replicas (ready at 4 and 5) have synced (5-6): the
    compute lost beside that sync slows the drain (B0 4-14, B1 14-24), not stage 1's gradients."""
    ranks, kind = ((0,), (1, 2)), get_schedule("1f1b")
    costs = [StageCosts(1.0, 10.0, 0.0, 0, ()), StageCosts(1.0, 2.0, 0.0, 0, (1.0,), lost_ms=5.0)]
    none = [costs[0], dataclasses.replace(costs[1], lost_ms=0.0)]
    assert barrier_step_ms(Topology(ranks, 2), kind, none) == pytest.approx(24.0)
    after = [costs[0], dataclasses.replace(costs[1], lost_after=True)]
    assert barrier_step_ms(Topology(ranks, 2), kind, after) == pytest.approx(29.0)
    alone = StageCosts(1.0, 2.0, 0.0, 0, (1.0,), lost_ms=5.0, lost_after=True, step_ms=0.5)
    # data parallelism: the sync (3-4) starts when the last compute ends: its own backward's end, 3 + 5 + 0.5
    assert barrier_step_ms(Topology(((0, 1),), 2), kind, [alone]) == pytest.approx(8.5)


def test_gradients_ready_where_the_backward_passed_them_and_the_step_after_the_sync():
    topo, kind = Topology(((0, 1),), 2), get_schedule("1f1b")
    even = StageCosts(1.0, 10.0, 0.0, 0, (3.0, 3.0))         # backward 1-11: layer 1 ready at 6, layer 0 at 11
    assert barrier_step_ms(topo, kind, [even]) == pytest.approx(14.0)
    late = dataclasses.replace(even, ready_share=(1.0, 0.9))   # layer 1 ready at 10 (10-13), layer 0 13-16
    assert barrier_step_ms(topo, kind, [late]) == pytest.approx(16.0)
    assert barrier_step_ms(topo, kind, [dataclasses.replace(late, step_ms=2.5)]) == pytest.approx(18.5)
    with pytest.raises(ValueError, match="ready shares"):
        StageCosts(1.0, 1.0, 0.0, 0, (1.0,), ready_share=(1.0, 0.5))


LAYERS = [(2.0, 4.0, 100_000, 4_000_000), (1.0, 2.0, 50_000, 12_000_000), (1.0, 3.0, 50_000, 1_000_000)]


def _setup(optimizer_ms: float):
    costs = dataclasses.replace(model_costs(make_profile(LAYERS)), step_ms=(("sgd", optimizer_ms),))
    return costs, CostModel(flat_cluster(4, gbps=10.0))


@pytest.mark.parametrize("stages", [
    (StageSpec(0, 4, (0,)),),                       # one rank: M (F + B) + its optimizer step
    (StageSpec(0, 4, (0, 1, 2, 3)),),               # data parallelism: the same lane as the formula's
])
def test_the_critical_path_is_the_formula_where_the_formula_is_exact(stages):
    costs, model = _setup(7.0)
    opts = Options(get_schedule("1f1b"), 4, "sgd")
    ev = evaluate(costs, model, stages, opts)
    assert predicted_step_ms(ev, costs, stages, opts) == pytest.approx(predict_step_ms(ev, opts), rel=1e-9)


def test_the_prediction_simulates_the_evaluated_terms_where_they_happen():
    costs, model = _setup(7.0)
    stages = (StageSpec(0, 1, (0,)), StageSpec(2, 2, (1, 2)), StageSpec(3, 4, (3,)))
    opts = Options(get_schedule("1f1b"), 8, "sgd")
    ev = evaluate(costs, model, stages, opts)
    charged = evaluated_costs(ev, costs, stages, opts)
    assert [c.step_ms for c in charged] == pytest.approx([s.overhead_ms for s in ev.stages])    # optimizer only
    assert [c.backward_ms for c in charged] == pytest.approx([s.backward_ms for s in ev.stages])
    assert charged[1].allreduce_ms == tuple(lv.predicted_ms for lv in ev.stages[1].sync.layers)
    got = predicted_step_ms(ev, costs, stages, opts)
    assert got == pytest.approx(barrier_step_ms(Topology(((0,), (1, 2), (3,)), 8), opts.schedule, charged))
    assert predicted_step_ms(ev, costs, stages, Options(get_schedule("pipedream"), 8, "sgd")) == ev.objective_ms
