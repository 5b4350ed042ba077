"""benchmarks/plans_prediction.py's pure parts: plans from runs, the noise floor, leave-one-plan-out."""

import argparse

import pytest

from benchmarks.plans_prediction import group_plans, plan_errors, pooled_ms, rerun_spreads, shrink_strength, summarize
from hybridpipe.partitioner.refine.observed import RunObservation, StageObservation


def _run(name: str, cut: int, steps: tuple[float, ...], predicted: float = 100.0) -> RunObservation:
    stages = (StageObservation(0, cut - 1, (0,), 1.0, 1.0, None, {}),
              StageObservation(cut, 9, (1,), 1.0, 1.0, None, {}))
    return RunObservation(name, stages, (), "1f1b", 4, sorted(steps)[len(steps) // 2], predicted, steps)


def test_runs_of_one_plan_pool_their_steps_and_their_reruns_give_the_noise_floor():
    runs = [_run("a1", 3, (100.0, 102.0, 98.0)), _run("b", 5, (200.0,)), _run("a2", 3, (110.0, 112.0, 108.0))]
    plans = group_plans(runs)
    assert [len(v) for v in plans.values()] == [2, 1]
    assert pooled_ms(plans[next(iter(plans))]) == pytest.approx(105.0)
    assert rerun_spreads(plans) == [pytest.approx(1 - 100 / 110)]


def test_leave_one_plan_out_never_trains_on_the_plan_it_predicts():
    runs = [_run("a1", 3, (100.0,)), _run("a2", 3, (104.0,)), _run("b", 5, (200.0,)), _run("c", 7, (300.0,))]
    seen = []

    def refiner(train):
        names = {r.name for r in train}
        seen.append(names)
        # a "model" that predicts the mean of the training runs' steps: nothing of the held-out plan leaks
        mean = sum(r.measured_step_ms for r in train) / len(train)
        return lambda run: mean
    errors = plan_errors(runs, refiner)
    assert seen[0] == {"a1", "a2", "b", "c"}                                   # in-sample: every run
    assert seen[1:] == [{"b", "c"}, {"a1", "a2", "c"}, {"a1", "a2", "b"}]        # each plan held out whole
    a = errors[0]
    assert a.measured_ms == pytest.approx(102.0) and a.leave_one_out_ms == pytest.approx(250.0)
    assert a.error(a.leave_one_out_ms) == pytest.approx(148 / 102)
    s = summarize([e.error(e.leave_one_out_ms) for e in errors])
    assert s["plans"] == 3 and s["within_3pct"] == 0
    assert a.model_ms is None
    again = plan_errors(runs, refiner, lambda run: 7.0 * len(run.name))     # the current model, unrefined
    assert [e.model_ms for e in again] == [14.0, 7.0, 7.0]                   # each plan's first run


def test_compute_factors_compare_each_stage_with_the_profile_of_its_nodes():
    from benchmarks.plans_prediction import compute_factors
    run = _run("a", 3, (100.0,))                  # stages 0-2 and 3-9, each 1 ms forward + 1 ms backward
    fwd, bwd = [0.5] * 10, [0.5] * 10
    assert compute_factors(run, fwd, bwd) == [pytest.approx(2 / 3, abs=1e-3), pytest.approx(2 / 7, abs=1e-3)]


def test_node_shrink_takes_cv_or_a_finite_strength():
    assert shrink_strength("cv") == "cv" and shrink_strength("8") == 8.0
    for bad in ("nan", "-1", "1e400", "abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            shrink_strength(bad)


def test_a_missing_results_file_is_one_line_and_exit_2(tmp_path, capsys):
    from benchmarks.plans_prediction import main
    assert main(["--work", str(tmp_path), "--results", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"plans_prediction: error: results file {tmp_path / 'missing.json'} does not exist\n", err
