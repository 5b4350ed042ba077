"""Refinement of a step's end (optimizer step, tied weights' sum), p2p from receivers, warm-up:
synthetic runs in which one of them is off the model, and the refinement recovers it."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpipe.partitioner.cost.calibration import Calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.planner import priced_tied
from hybridpipe.partitioner.refine.refinement import (
    nominal_calibration,
    predict_run,
    refine,
    refined_calibrations,
    refined_profile,
)
from hybridpipe.partitioner.refine.step import StepFactors, StepStage, TiedEvidence, fit_step, weighted_median
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import Options
from tests.partitioner.synth import flat_cluster, make_profile
from tests.partitioner.synth_runs import synthetic_run

LAYERS = [(4.0, 8.0, 2_000_000, 100_000), (3.0, 6.0, 1_000_000, 8_000_000), (2.0, 4.0, 400_000, 3_000_000),
          (0.5, 1.0, 16_000, 60_000_000), (0.2, 0.4, 4_000, 4_000_000)]
CLUSTER = flat_cluster(4, gbps=1.0, latency_us=50)
STAGES = [StageSpec(0, 1, (0,)), StageSpec(2, 3, (1,)), StageSpec(4, 4, (2,)), StageSpec(5, 6, (3,))]


def with_step(profile, sgd_ms: float):
    return dataclasses.replace(profile, totals=dataclasses.replace(profile.totals, sgd_step_ms=sgd_ms))


def tied_profile():
    """LAYERS with layer 5 (node 5) reading layer 2's weight (8 MB) too (a tied embedding and head)."""
    prof = with_step(make_profile(LAYERS, model="tied"), 40.0)
    nodes = list(prof.nodes)
    nodes[5] = dataclasses.replace(nodes[5], shared=("l2.weight",), shared_bytes=(nodes[2].param_bytes,))
    return dataclasses.replace(prof, nodes=tuple(nodes))


def test_an_optimizer_step_slower_than_profiled_is_recovered_per_parameter_byte():
    prof = with_step(make_profile(LAYERS, model="opt"), 40.0)
    run = synthetic_run(prof, CLUSTER, STAGES, optimizer_factor=2.5)
    ref = refine(prof, CLUSTER, (), [run])
    assert ref.optimizer_factor == pytest.approx(2.5, rel=0.02)
    refined = refined_profile(prof, ref)
    assert refined.totals.sgd_step_ms == pytest.approx(100.0, rel=0.02)
    truth = with_step(prof, 100.0)
    cals = refined_calibrations(CLUSTER, (), ref)
    assert predict_run(refined, CLUSTER, cals, run) == pytest.approx(predict_run(truth, CLUSTER, (), run), rel=0.01)


def test_a_tied_sum_slower_than_priced_is_recovered_apart_from_the_optimizer_and_the_drain_wait():
    prof = tied_profile()
    groups = priced_tied(prof, STAGES, CostModel(CLUSTER))
    assert [g.stages for g in groups] == [(1, 3)] and groups[0].predicted_ms > 10
    run = synthetic_run(prof, CLUSTER, STAGES, optimizer_factor=1.5, tied_factor=3.0, drain_ms=80.0)
    ref = refine(prof, CLUSTER, (), [run])
    assert ref.tied_factor == pytest.approx(3.0, rel=0.02)
    assert ref.optimizer_factor == pytest.approx(1.5, rel=0.02)
    cal = refined_calibrations(CLUSTER, (), ref)[-1]
    assert cal.tied_slowdown == pytest.approx(3.0, rel=0.02)
    again = priced_tied(prof, STAGES, CostModel(CLUSTER, [cal]))
    assert again[0].predicted_ms == pytest.approx(3.0 * groups[0].predicted_ms, rel=0.02)
    back = Calibration.from_dict(cal.to_dict())
    assert back.tied_slowdown == pytest.approx(cal.tied_slowdown)


def test_the_run_prediction_counts_tied_sums_so_they_do_not_land_in_the_step_overhead():
    prof = tied_profile()
    nominal = nominal_calibration(CostModel(CLUSTER), 0)
    truth = dataclasses.replace(nominal, tied_slowdown=2.0, step_overhead_ms=5.0)
    probe = synthetic_run(prof, CLUSTER, STAGES, tied_factor=2.0)
    measured = predict_run(prof, CLUSTER, [truth], probe)
    assert measured > predict_run(prof, CLUSTER, [dataclasses.replace(truth, tied_slowdown=1.0)], probe)
    run = synthetic_run(prof, CLUSTER, STAGES, tied_factor=2.0, measured_step_ms=measured)
    ref = refine(prof, CLUSTER, (), [run])
    assert ref.step_overhead_ms == pytest.approx(5.0, abs=0.5)
    cals = refined_calibrations(CLUSTER, (), ref)
    assert predict_run(refined_profile(prof, ref), CLUSTER, cals, run) == pytest.approx(measured, rel=0.01)


def test_p2p_is_read_from_receivers_when_sends_return_before_their_bytes_leave():
    prof = make_profile(LAYERS, model="p2p")
    run = synthetic_run(prof, CLUSTER, STAGES, p2p_factor=2.0, sender_ratio=0.2)
    assert {t.sent for t in run.transfers} == {True, False}
    ref = refine(prof, CLUSTER, (), [run])
    assert dict(ref.p2p_factor)[0] == pytest.approx(2.0, rel=0.02)


def test_the_first_step_is_left_out_even_when_the_summary_counts_no_warm_up():
    prof = make_profile(LAYERS, model="warm")
    run = synthetic_run(prof, CLUSTER, STAGES, steps=2, first_step_factor=4.0, warmup_steps=0)
    ref = refine(prof, CLUSTER, (), [run])
    assert all(f == pytest.approx(1.0, rel=0.01) for f in ref.forward_factor[1:6])


def test_fit_step_pure():
    # two plain stages fix the optimizer factor; the tied group's real sum is its least stage's
    runs = [[StepStage(10.0, 0.0, 20.0), StepStage(30.0, 0.0, 60.0), StepStage(5.0, 4.0, 10.0 + 12.0),
             StepStage(1.0, 4.0, 2.0 + 12.0 + 100.0)]]
    fit = fit_step(runs, [[TiedEvidence((2, 3), 4.0)]])
    assert fit.optimizer == pytest.approx(2.0) and fit.tied == pytest.approx(3.0)
    # every stage in a tied group: the step phases cannot tell the optimizer from the sum
    runs = [[StepStage(10.0, 4.0, 20.0 + 12.0), StepStage(30.0, 4.0, 60.0 + 12.0 + 50.0)]]
    assert fit_step(runs, [[TiedEvidence((0, 1), 4.0)]]) == StepFactors(None, None)
    assert fit_step([[StepStage(0.0, 0.0, 0.3)]], [[]]) == StepFactors(None, None)


def test_compute_lost_to_the_link_is_fitted_apart_from_the_nodes_and_not_counted_twice():
    """A dp run (big ring) and a pipeline run (small p2p) whose compute both lose 4 ns per link
    byte: the refinement finds the 4 ns, leaves the nodes at 1x, and re-predicts both runs as
    the truth (the calibrated interference is replaced, not added to what the compute saw)."""
    prof = make_profile(LAYERS, model="lost")
    cluster = flat_cluster(4, gbps=10.0, latency_us=50)
    calibrated = dataclasses.replace(nominal_calibration(CostModel(cluster), 0), interference_s_per_byte=9e-9)
    truth = dataclasses.replace(calibrated, interference_s_per_byte=4e-9)
    layouts = [[StageSpec(0, 6, (0, 1, 2, 3))], STAGES]
    runs = [synthetic_run(prof, cluster, st, name=f"r{k}", interference_s_per_byte=4e-9)
            for k, st in enumerate(layouts)]
    ref = refine(prof, cluster, [calibrated], runs)
    assert ref.interference_s_per_byte == pytest.approx(4e-9, rel=0.05)
    assert all(f == pytest.approx(1.0, rel=0.05) for f in ref.backward_factor[1:6])
    cals = refined_calibrations(cluster, [calibrated], ref)
    # the pipeline (no all-reduce) re-predicted as the truth; the dp stage's compute and overhead too
    assert predict_run(refined_profile(prof, ref), cluster, cals, runs[1]) == pytest.approx(
        predict_run(prof, cluster, [truth], runs[1]), rel=0.02)
    opts = Options(get_schedule("1f1b"), 8)
    got = evaluate(model_costs(refined_profile(prof, ref)), CostModel(cluster, list(cals)), layouts[0], opts).stages[0]
    want = evaluate(model_costs(prof), CostModel(cluster, [truth]), layouts[0], opts).stages[0]
    assert got.overhead_ms + 2 * (got.forward_ms + got.backward_ms) == pytest.approx(
        want.overhead_ms + 2 * (want.forward_ms + want.backward_ms), rel=0.02)


def test_fit_interference_pure():
    from hybridpipe.partitioner.refine.interference import StageLoad, fit_interference
    loads = [StageLoad(100.0, 1.3 * 100 + 2e-6 * 50e6, 50e6, 49e6), StageLoad(200.0, 1.3 * 200 + 2e-6 * 1e6, 1e6)]
    assert fit_interference(loads) == pytest.approx(2e-6, rel=1e-6)
    assert fit_interference(loads[:1]) == 0.0                                   # one stage: cannot tell
    assert fit_interference([StageLoad(100.0, 150.0, 1e6, 1e6), StageLoad(200.0, 300.0, 2e6)]) == 0.0   # same density
    no_ring = [StageLoad(s.profiled_ms, s.measured_ms, s.nbytes) for s in loads]
    assert fit_interference(no_ring) == 0.0                   # p2p alone: a slow node could pass for it


def test_size_class_factors_are_refitted_until_every_stage_waits_what_it_measured():
    """A dp stage with small and big layers and a replicated stage of small layers only: the
    classes' factors, applied per layer by its size, reproduce both stages' measured waits."""
    from hybridpipe.partitioner.cost.costmodel import size_factor
    from hybridpipe.partitioner.refine.sync import lane_wait_ms

    prof = make_profile([(5.0, 10.0, 100_000, 4_000_000), (5.0, 10.0, 100_000, 50_000),
                         (5.0, 10.0, 100_000, 4_000_000), (5.0, 10.0, 100_000, 50_000),
                         (5.0, 10.0, 100_000, 50_000)], model="mixed")
    cluster = flat_cluster(4, gbps=1.0, latency_us=2000)
    slow = lambda b: 4.0 if b > 1e6 else 1.2                                       # noqa: E731
    runs = [synthetic_run(prof, cluster, [StageSpec(0, 6, (0, 1, 2, 3))], name="dp", allreduce_factor=slow),
            synthetic_run(prof, cluster, [StageSpec(0, 3, (0,)), StageSpec(4, 6, (1, 2, 3))], name="hybrid",
                          allreduce_factor=slow)]
    ref = refine(prof, cluster, (), runs)
    assert len(ref.allreduce_slowdown) >= 2
    for e in ref.sync:
        base = [s * size_factor(ref.allreduce_slowdown, b) for s, b in zip(e.sync_ms, e.sizes, strict=True)]
        import numpy as np
        got = lane_wait_ms(base, np.array(e.backward_ms), np.array(e.forward_ms))
        assert got == pytest.approx(e.measured_wait_ms, rel=0.03, abs=0.05)


def test_one_stage_whose_step_crawled_does_not_set_the_optimizer_factor():
    # the small stage waited 45x its price (the machine's CPU went to another stage's all-reduce)
    runs = [[StepStage(29.0, 0.0, 1294.0), StepStage(292.0, 0.0, 147.0 * 292 / 292), StepStage(162.0, 0.0, 91.0)],
            [StepStage(145.0, 0.0, 270.0 * 145 / 292), StepStage(162.0, 0.0, 87.0)]]
    o = fit_step(runs, [[], []]).optimizer
    assert o is not None and 0.45 < o < 0.65          # the big stages' ratios (0.50-0.56), not 3.2x
    assert weighted_median([1.0, 5.0, 2.0], [1.0, 1.0, 3.0]) == 2.0


def _lost_beside_runs():
    """Three layouts measured with 5e-9 s per byte lost beside the all-reduces, 2 ms overhead per step."""
    prof = make_profile([(5.0, 10.0, 100_000, 10_000_000)] * 4, model="even")
    cluster = flat_cluster(4, gbps=10.0, latency_us=20)
    truth = dataclasses.replace(nominal_calibration(CostModel(cluster), 0), interference_s_per_byte=5e-9,
                                step_overhead_ms=2.0)
    layouts = [[StageSpec(0, 5, (0, 1, 2, 3))], [StageSpec(0, 2, (0, 1)), StageSpec(3, 5, (2, 3))],
               [StageSpec(0, 1, (0,)), StageSpec(2, 2, (1,)), StageSpec(3, 3, (2,)), StageSpec(4, 5, (3,))]]
    runs = []
    for k, stages in enumerate(layouts):
        probe = synthetic_run(prof, cluster, stages, name=f"r{k}")
        runs.append(synthetic_run(prof, cluster, stages, name=f"r{k}",
                                  measured_step_ms=predict_run(prof, cluster, [truth], probe)))
    return prof, cluster, runs


def test_compute_lost_beside_all_reduces_that_only_the_step_times_show_is_fitted_there():
    """On hosts that share CPUs, a big all-reduce slows the other stages, not its own compute
    phases: the stages' compute says nothing, the measured steps do. The loss is fitted to the
    steps (beside the message latency and the overhead) and re-predicts every run."""
    prof, cluster, runs = _lost_beside_runs()
    ref = refine(prof, cluster, (), runs)
    assert ref.interference_s_per_byte == pytest.approx(5e-9, rel=0.05)
    cals = refined_calibrations(cluster, (), ref)
    for run in runs:
        assert predict_run(refined_profile(prof, ref), cluster, cals, run) == pytest.approx(run.measured_step_ms,
                                                                                            rel=0.01)


def test_without_the_step_loss_the_loss_stays_what_the_stages_compute_showed():
    """``step_loss=False``: the same runs refine to no loss (their stages' compute showed none), and the latency
    and overhead alone cannot re-predict them (with the loss fitted: within 1%, the test above)."""
    prof, cluster, runs = _lost_beside_runs()
    ref = refine(prof, cluster, (), runs, step_loss=False)
    assert ref.interference_s_per_byte == 0.0
    cals = refined_calibrations(cluster, (), ref)
    errors = [predict_run(refined_profile(prof, ref), cluster, cals, r) / r.measured_step_ms - 1 for r in runs]
    assert max(abs(e) for e in errors) > 0.05
