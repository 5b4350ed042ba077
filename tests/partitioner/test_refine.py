"""refine/refinement.py: synthetic runs whose nodes, all-reduces and transfers are slower than the model say
so, and the refinement recovers the factors and moves the plan where the truth moves it."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, load_calibration, save_calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.refine.refinement import (
    nominal_calibration,
    predict_run,
    refine,
    refined_calibrations,
    refined_profile,
)
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.objective import StageSpec
from tests.partitioner.synth import flat_cluster, make_profile, two_level
from tests.partitioner.synth_runs import synthetic_run

LAYERS = [(4.0, 8.0, 2_000_000, 100_000), (3.0, 6.0, 1_000_000, 2_000_000), (2.0, 4.0, 400_000, 3_000_000),
          (0.5, 1.0, 16_000, 60_000_000), (0.2, 0.4, 4_000, 4_000_000)]
CONVFC = make_profile(LAYERS, skips=[(1, 4)], model="synthetic-convfc")
CONVFC_CLUSTER = two_level(1, 4, outer_gbps=1.0, memory_gb=4.0)
EVEN = make_profile([(5.0, 10.0, 100_000, 10_000_000)] * 4, model="synthetic-even")
EVEN_CLUSTER = flat_cluster(4, gbps=10.0, latency_us=20)


def layout(plan) -> list[tuple[int, int, int]]:
    return [(s.first_node, s.last_node, s.replicas) for s in plan.stages]


def slowed_nodes(profile, factors: dict[int, float]):
    """The truth: ``profile`` with node i computing factors[i] times slower."""
    return dataclasses.replace(profile, nodes=tuple(
        dataclasses.replace(n, forward_ms=n.forward_ms * factors.get(n.id, 1.0),
                            backward_ms=n.backward_ms * factors.get(n.id, 1.0)) for n in profile.nodes))


def refined_partition(profile, cluster, runs, cals=()):
    ref = refine(profile, cluster, cals, runs)
    return ref, partition(refined_profile(profile, ref), cluster, Request(), refined_calibrations(cluster, cals, ref))


def test_a_node_twice_as_slow_as_profiled_is_recovered_and_moves_the_plan():
    stages = [StageSpec(0, 1, (0,)), StageSpec(2, 3, (1,)), StageSpec(4, 4, (2,)), StageSpec(5, 6, (3,))]
    run = synthetic_run(CONVFC, CONVFC_CLUSTER, stages, node_factor=lambda i: 2.0 if i == 4 else 1.0)
    ref, out = refined_partition(CONVFC, CONVFC_CLUSTER, [run])
    assert ref.forward_factor[4] == pytest.approx(2.0, rel=0.05)
    assert ref.backward_factor[4] == pytest.approx(2.0, rel=0.05)
    assert all(ref.forward_factor[i] == pytest.approx(1.0, rel=0.05) for i in (1, 2, 3, 5))
    # the refined profile times the refined calibration's compute slowdown are the truth
    prof = refined_profile(CONVFC, ref)
    cal = refined_calibrations(CONVFC_CLUSTER, (), ref)[-1]
    for n, m in zip(CONVFC.nodes, prof.nodes, strict=True):
        truth = n.forward_ms * (2.0 if n.id == 4 else 1.0)
        assert m.forward_ms * cal.compute_slowdown == pytest.approx(truth, rel=1e-6)
    before = partition(CONVFC, CONVFC_CLUSTER, Request())
    oracle = partition(slowed_nodes(CONVFC, {4: 2.0}), CONVFC_CLUSTER, Request())
    assert layout(before.plan) != layout(oracle.plan)
    assert layout(out.plan) == layout(oracle.plan)
    assert out.plan.predicted_step_ms == pytest.approx(oracle.plan.predicted_step_ms, rel=0.05)
    assert prof.signature() == CONVFC.signature()


def test_node_factors_are_fitted_across_runs_with_different_stages():
    truth = {4: 2.0, 2: 1.5}
    runs = [synthetic_run(CONVFC, CONVFC_CLUSTER, [StageSpec(0, 1, (0, 1)), StageSpec(2, 4, (2,)),
                                                   StageSpec(5, 6, (3,))], node_factor=lambda i: truth.get(i, 1.0)),
            synthetic_run(CONVFC, CONVFC_CLUSTER, [StageSpec(0, 2, (0,)), StageSpec(3, 3, (1,)), StageSpec(4, 5, (2,)),
                                                   StageSpec(6, 6, (3,))], node_factor=lambda i: truth.get(i, 1.0))]
    ref = refine(CONVFC, CONVFC_CLUSTER, (), runs)
    costs = {i: (CONVFC.nodes[i].forward_ms, CONVFC.nodes[i].backward_ms) for i in range(len(CONVFC.nodes))}
    # every stage of both runs is reproduced (the data's only constraints), and the isolated nodes exactly
    for run in runs:
        for st in run.stages:
            got = sum(costs[i][0] * ref.forward_factor[i] for i in range(st.first, st.last + 1))
            assert got == pytest.approx(st.forward_ms, rel=0.01)
    assert ref.forward_factor[3] == pytest.approx(1.0, rel=0.05)
    assert ref.forward_factor[2] == pytest.approx(1.5, rel=0.05)


def test_an_allreduce_three_times_slower_is_recovered_and_drops_the_replication():
    before = partition(EVEN, EVEN_CLUSTER, Request())
    assert layout(before.plan) == [(0, 5, 4)]                       # data parallel, as the model says
    stages = [StageSpec(s.first_node, s.last_node, s.ranks) for s in before.plan.stages]
    run = synthetic_run(EVEN, EVEN_CLUSTER, stages, allreduce_factor=lambda b: 3.0)
    ref, out = refined_partition(EVEN, EVEN_CLUSTER, [run])
    assert len(ref.allreduce_slowdown) == 1
    assert ref.allreduce_slowdown[0][1] == pytest.approx(3.0, rel=0.05)
    assert ref.compute_slowdown == pytest.approx(1.0, rel=1e-6)
    truth = dataclasses.replace(nominal_calibration(CostModel(EVEN_CLUSTER), 0), allreduce_slowdown=((1.0, 3.0),))
    oracle = partition(EVEN, EVEN_CLUSTER, Request(), [truth])
    assert layout(oracle.plan) != layout(before.plan)
    assert layout(out.plan) == layout(oracle.plan)
    # the run's own plan, re-predicted with what was learnt, matches what it measured (the truth)
    cals = refined_calibrations(EVEN_CLUSTER, (), ref)
    assert predict_run(refined_profile(EVEN, ref), EVEN_CLUSTER, cals, run) == pytest.approx(
        predict_run(EVEN, EVEN_CLUSTER, [truth], run), rel=0.05)


def test_each_size_class_gets_its_own_allreduce_factor():
    prof = make_profile([(5.0, 10.0, 100_000, 20_000_000), (5.0, 10.0, 100_000, 20_000_000),
                         (5.0, 10.0, 100_000, 50_000), (5.0, 10.0, 100_000, 50_000)], model="two-sizes")
    cluster = flat_cluster(4, gbps=1.0, latency_us=200)
    stages = [StageSpec(0, 2, (0, 1)), StageSpec(3, 5, (2, 3))]
    run = synthetic_run(prof, cluster, stages, allreduce_factor=lambda b: 3.0 if b > 1e6 else 1.0)
    ref = refine(prof, cluster, (), [run])
    (small, f_small), (big, f_big) = ref.allreduce_slowdown
    assert small < 1e6 < big
    assert f_big == pytest.approx(3.0, rel=0.05)
    assert f_small == pytest.approx(1.0, rel=0.05)
    model = CostModel(cluster, list(refined_calibrations(cluster, (), ref)))
    assert model.allreduce_factor(20e6) == pytest.approx(3.0, rel=0.05)
    assert model.allreduce_factor(50e3) == pytest.approx(1.0, rel=0.05)


def test_p2p_transfers_slower_than_calibrated_scale_the_link():
    stages = [StageSpec(0, 2, (0,)), StageSpec(3, 6, (1,))]
    cluster = flat_cluster(2, gbps=1.0, latency_us=50)
    run = synthetic_run(CONVFC, cluster, stages, p2p_factor=2.5)
    ref = refine(CONVFC, cluster, (), [run])
    assert dict(ref.p2p_factor)[0] == pytest.approx(2.5, rel=0.05)
    before, after = CostModel(cluster), CostModel(cluster, list(refined_calibrations(cluster, (), ref)))
    assert after.p2p_seconds(1e6, 0) == pytest.approx(2.5 * before.p2p_seconds(1e6, 0), rel=0.05)
    assert after.allreduce_seconds("ring", 1e6, [0, 1]) == pytest.approx(before.allreduce_seconds("ring", 1e6, [0, 1]))


def test_the_refined_calibration_is_reused_by_another_model_on_the_cluster(tmp_path):
    run = synthetic_run(EVEN, EVEN_CLUSTER, [StageSpec(0, 5, (0, 1, 2, 3))], node_factor=lambda i: 1.3,
                        allreduce_factor=lambda b: 3.0)
    ref = refine(EVEN, EVEN_CLUSTER, (), [run])
    assert ref.compute_slowdown == pytest.approx(1.3, rel=1e-3)
    path = save_calibration(refined_calibrations(EVEN_CLUSTER, (), ref)[0], tmp_path / "cal.json")
    cal = load_calibration(path)
    assert cal.compute_slowdown == pytest.approx(1.3, rel=1e-3) and cal.refined_from == ("run",)
    other = make_profile([(2.0, 4.0, 50_000, 8_000_000)] * 6, model="other")
    plain = partition(other, EVEN_CLUSTER, Request(strategy="uniform", stages=2))
    reused = partition(other, EVEN_CLUSTER, Request(strategy="uniform", stages=2), [cal])
    for a, b in zip(plain.plan.stages, reused.plan.stages, strict=True):
        assert b.forward_ms == pytest.approx(1.3 * a.forward_ms, rel=1e-3)
    truth = dataclasses.replace(nominal_calibration(CostModel(EVEN_CLUSTER), 0), allreduce_slowdown=((1.0, 3.0),),
                                compute_slowdown=1.3)
    assert reused.plan.predicted_step_ms == pytest.approx(
        partition(other, EVEN_CLUSTER, Request(strategy="uniform", stages=2), [truth]).plan.predicted_step_ms, rel=0.05)


def test_refining_again_composes_with_an_earlier_refinement():
    run = synthetic_run(EVEN, EVEN_CLUSTER, [StageSpec(0, 5, (0, 1, 2, 3))], node_factor=lambda i: 1.5,
                        allreduce_factor=lambda b: 2.0)
    first = refined_calibrations(EVEN_CLUSTER, (), refine(EVEN, EVEN_CLUSTER, (), [run]))
    # a second model's run on the same cluster, judged against the refined calibration, finds nothing new
    again = refine(EVEN, EVEN_CLUSTER, first, [run])
    assert again.compute_slowdown == pytest.approx(1.0, rel=0.02)
    assert again.allreduce_slowdown[0][1] == pytest.approx(1.0, rel=0.05)
    second = refined_calibrations(EVEN_CLUSTER, first, again)[0]
    assert second.compute_slowdown == pytest.approx(1.5, rel=0.02)
    assert second.allreduce_slowdown[0][1] == pytest.approx(2.0, rel=0.05)


def test_calibration_format_1_is_kept_without_refinement_and_format_2_is_validated(tmp_path):
    cal = nominal_calibration(CostModel(EVEN_CLUSTER), 0)
    assert cal.to_dict()["format"] == 1 and "compute_slowdown" not in cal.to_dict()
    d = dataclasses.replace(cal, allreduce_slowdown=((1e6, 2.0),), refined_from=("r",)).to_dict()
    assert d["format"] == 2
    assert Calibration.from_dict(d).allreduce_slowdown == ((1e6, 2.0),)
    for bad in ([[1e6]], [[1e6, -1]], [[2e6, 1.0], [1e6, 1.0]], "x"):
        with pytest.raises(UserError, match="allreduce_slowdown"):
            Calibration.from_dict(dict(d, allreduce_slowdown=bad))
    with pytest.raises(UserError, match="format 4"):                     # format 3 (group_fits) reads, 4 not
        Calibration.from_dict(dict(d, format=4))


def test_refine_refuses_runs_that_do_not_belong_to_the_profile_or_cluster():
    with pytest.raises(UserError, match="at least one run"):
        refine(EVEN, EVEN_CLUSTER, (), [])
    run = synthetic_run(CONVFC, CONVFC_CLUSTER, [StageSpec(0, 6, (0, 1, 2, 3))])
    with pytest.raises(UserError, match="not nodes"):
        refine(EVEN, EVEN_CLUSTER, (), [run])
    with pytest.raises(UserError, match="outside the cluster"):
        refine(CONVFC, flat_cluster(2), (), [run])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
def test_the_optimal_search_with_a_refined_calibration_equals_brute_force(schedule):
    """The all-reduce size factors reach the DP's vectorised sync tables as they reach evaluate()."""
    from hybridpipe.partitioner.search import dp
    from hybridpipe.partitioner.search.modelcosts import model_costs
    from hybridpipe.partitioner.search.objective import evaluate
    from hybridpipe.partitioner.search.options import Options
    from hybridpipe.partitioner.search.strategies import baseline_stages
    from tests.partitioner.synth import brute_force

    prof = make_profile([(2.0, 4.0, 300_000, 60_000_000), (1.0, 2.0, 200_000, 50_000), (3.0, 6.0, 100_000, 4_000_000)])
    cluster = flat_cluster(4, gbps=10.0, latency_us=50)
    cal = dataclasses.replace(nominal_calibration(CostModel(cluster), 0),
                              allreduce_slowdown=((1e5, 1.0), (5e6, 2.0), (6e7, 4.0)), compute_slowdown=1.2)
    model = CostModel(cluster, [cal])
    opts = Options(get_schedule(schedule), 4)
    costs = model_costs(prof).slowed(model.compute_slowdown)
    bound = evaluate(costs, model, baseline_stages("dp", costs, 4), opts).objective_ms
    sol = dp.solve(costs, model, 4, opts, bound)
    best, _ = brute_force(costs, model, 4, opts, dp.copy_counts(model, 4))
    assert sol.objective_ms == pytest.approx(best, rel=1e-9)
    assert evaluate(costs, model, sol.stages, opts).objective_ms == pytest.approx(best, rel=1e-9)


def test_message_latency_and_step_overhead_are_fitted_and_one_plan_the_model_cannot_explain_does_not_set_them():
    # three plans measured as the truth prices them and one 30% slower than anything the model can say (a slowed
    # host, as AlexNet's fc1 pair in RESULTS 4e): the latency and the overhead are still the truth's, and the
    # plans the model explains are predicted right (the least squares let the outlier pull both)
    cluster = flat_cluster(4, gbps=10.0, latency_us=20)
    fit = CostModel(cluster).link(0)
    truth_ref = dataclasses.replace(nominal_calibration(CostModel(cluster), 0), step_overhead_ms=3.0,
                                    p2p=dataclasses.replace(fit, alpha_s=fit.alpha_s + 0.002),
                                    algorithms={a: fit for a in ALGORITHMS})
    layouts = [[StageSpec(0, 5, (0, 1, 2, 3))], [StageSpec(0, 2, (0, 1)), StageSpec(3, 5, (2, 3))],
               [StageSpec(0, 1, (0,)), StageSpec(2, 2, (1,)), StageSpec(3, 3, (2,)), StageSpec(4, 5, (3,))],
               [StageSpec(0, 3, (0, 1)), StageSpec(4, 5, (2, 3))]]
    runs = []
    for k, stages in enumerate(layouts):
        probe = synthetic_run(EVEN, cluster, stages, name=f"r{k}")
        measured = predict_run(EVEN, cluster, [truth_ref], probe) * (1.3 if k == 3 else 1.0)
        runs.append(synthetic_run(EVEN, cluster, stages, name=f"r{k}", measured_step_ms=measured))
    ref = refine(EVEN, cluster, (), runs)
    assert dict(ref.p2p_extra_alpha_s)[0] == pytest.approx(0.002, rel=0.05)
    assert ref.step_overhead_ms == pytest.approx(3.0, rel=0.05)
    cals = refined_calibrations(cluster, (), ref)
    for run in runs[:3]:
        assert predict_run(refined_profile(EVEN, ref), cluster, cals, run) == pytest.approx(run.measured_step_ms,
                                                                                            rel=0.01)
