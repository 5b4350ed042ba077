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
