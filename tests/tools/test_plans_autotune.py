"""benchmarks/plans_autotune.py's pure parts: steady steps, the fastest strategy, the summary (no processes)."""

import pytest

from benchmarks.plans_autotune import autotune_summary, fastest_strategy, steady_steps


def _tuned(ms: float, paired: dict | None, errors=(0.02, -0.08, 0.04)) -> dict:
    trials = [{"error_final": e} for e in errors]
    return {"model": "m", "hosts": 4, "strategy": "autotune", "measured_step_ms": ms,
            "autotune": {"runs": len(errors), "error_final": errors[0], "stop_reason": "budget", "trials": trials,
                         **({"paired": paired} if paired is not None else {})}}


def _rows(tuned: dict) -> list[dict]:
    return [{"model": "m", "hosts": 4, "strategy": "optimal", "measured_step_ms": 110.0},
            {"model": "m", "hosts": 4, "strategy": "time", "measured_step_ms": 100.0},
            {"model": "m", "hosts": 4, "strategy": "pipedream", "measured_step_ms": 90.0, "same_plan_as": "time"},
            tuned]


def test_steady_steps_leave_out_the_warm_up_in_step_order():
    summary = {"warmup_steps": 1, "job_step_ms": {"10": 5.0, "2": 9.0, "3": 4.0}}
    assert steady_steps(summary) == [4.0, 5.0]
    warming = {"warmup_steps": 1, "job_step_ms": {str(k): v for k, v in enumerate([9.0, 8.0, 5.0, 4.5, 5.0, 4.5])}}
    assert steady_steps(warming) == [5.0, 4.5, 5.0, 4.5]      # step 1, still 1.6x the steps after it, left out


def test_the_fastest_strategy_skips_autotune_and_duplicates():
    assert fastest_strategy(_rows(_tuned(50.0, None)))["strategy"] == "time"


def test_the_paired_ratio_decides_the_aim_where_it_ran():
    unpaired = autotune_summary(_rows(_tuned(108.0, None)))["groups"][0]
    assert unpaired["vs_fastest"] == pytest.approx(1.08) and not unpaired["fastest_or_within"]
    paired = autotune_summary(_rows(_tuned(108.0, {"ratio": 1.01})))
    g = paired["groups"][0]
    assert g["vs_fastest_paired"] == 1.01 and g["fastest_or_within"] and g["fastest_strategy"] == "time"
    assert paired["median_abs_error_final"] == pytest.approx(0.04) and paired["runs_with_error_final"] == 3
    assert g["median_abs_error_final_runs"] == pytest.approx(0.04)


def _plan(tmp_path, name: str, last_first: int) -> "object":
    from hybridpipe.jsonfile import write_json
    path = tmp_path / f"{name}.json"
    write_json(path, {"schedule": "1f1b", "micro_batches": 8, "batch_size": 4,
                      "stages": [{"first_node": 0, "last_node": last_first - 1, "replicas": 1, "ranks": [0]},
                                 {"first_node": last_first, "last_node": 9, "replicas": 1, "ranks": [1]}]})
    return path


def test_the_pairing_alternates_the_order_runs_a_duplicate_once_and_reports_each_plans_rerun_spread(tmp_path):
    from benchmarks.plans_autotune import paired_comparison
    tuned, fastest, uniform = _plan(tmp_path, "a", 3), _plan(tmp_path, "f", 5), _plan(tmp_path, "u", 7)
    speed = {"a": 100.0, "f": 110.0, "u": 150.0}
    order = []

    def train(plan, run_dir):
        order.append(plan.stem)
        slow = 1.0 + 0.1 * (len(order) > 3)          # the load rises in the second round
        return {"warmup_steps": 1, "job_step_ms": {"0": 999.0, "1": speed[plan.stem] * slow,
                                                   "2": speed[plan.stem] * slow}}
    out = paired_comparison(train, tuned, fastest, tmp_path / "pairs", 2, {"uniform": uniform, "optimal": tuned})
    assert order == ["a", "f", "u", "u", "f", "a"]            # A B C, C B A; optimal = autotune's plan: not run
    assert out["same_as"] == {"optimal": "autotune"} and not out["same_plan"]
    assert out["vs"]["uniform"] == pytest.approx(100 / 150, abs=1e-3) and out["vs"]["optimal"] == 1.0
    assert out["ratio"] == pytest.approx(100 / 110, abs=1e-3)
    assert out["rerun_spread"]["autotune"] == pytest.approx(0.1)
    assert out["round_medians_ms"]["fastest"] == [110.0, pytest.approx(121.0)]
