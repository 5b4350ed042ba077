"""tuning.py: autotune's choice of the next plan and of when to stop."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.refine.tuning import (
    Trial,
    decide,
    distinct,
    fastest_measured,
    median_noise,
    plan_key,
    pooled,
)
from tests.partitioner.synth import make_profile, two_level

PROFILE = make_profile([(4.0, 8.0, 2_000_000, 100_000), (3.0, 6.0, 1_000_000, 2_000_000),
                        (0.5, 1.0, 16_000, 60_000_000)])
CLUSTER = two_level(1, 4, outer_gbps=1.0, memory_gb=4.0)


def plans(predicted: dict[str, float]):
    """Every strategy's plan with its predicted step replaced (to steer the ranking)."""
    out = []
    for name, ms in predicted.items():
        plan = partition(PROFILE, CLUSTER, Request(strategy=name)).plan
        out.append((name, dataclasses.replace(plan, predicted_step_ms=ms)))
    return out


def test_equal_plans_are_merged_and_ranked_by_prediction():
    found = distinct(plans({"dp": 30.0, "uniform": 20.0, "params": 25.0}))
    assert [c.predicted_ms for c in found] == sorted(c.predicted_ms for c in found)
    again = distinct([*plans({"dp": 30.0}), ("dp-again", plans({"dp": 31.0})[0][1])])
    assert len(again) == 1 and again[0].strategies == ("dp", "dp-again")
    assert plan_key(again[0].plan) == again[0].key


def test_the_best_predicted_plan_runs_first_then_runner_ups_then_it_stops():
    found = distinct(plans({"uniform": 20.0, "params": 21.0, "dp": 40.0}))
    best, runner = found[0], found[1]
    first = decide(found, [])
    assert first.candidate is best and "best plan" in first.reason
    # it ran and measured far from its prediction: the close runner-up is tried
    second = decide(found, [Trial(best.key, 15.0, 20.0)])
    assert second.candidate is runner and "runner-up" in second.reason
    # both ran; the rest is not close: stop
    third = decide(found, [Trial(best.key, 15.0, 20.0), Trial(runner.key, 21.0, 25.0)])
    assert third.candidate is None and "no untried plan" in third.reason


def test_it_converges_when_the_best_predicted_is_the_fastest_measured_and_was_predicted_well():
    found = distinct(plans({"uniform": 20.0, "params": 21.0}))
    best = found[0]
    done = decide(found, [Trial(best.key, 20.5, 20.0)], tolerance=0.05)
    assert done.candidate is None and done.reason.startswith("converged")
    # predicted 30% off before it ran: not trusted yet, the runner-up is measured
    assert decide(found, [Trial(best.key, 26.0, 20.0)], tolerance=0.05).candidate is found[1]
    # a faster measured plan that the model ranks second: not converged either
    not_best = decide(found, [Trial(best.key, 20.0, 20.0), Trial(found[1].key, 21.0, 10.0)])
    assert not_best.candidate is None and "no untried plan" in not_best.reason


def test_a_plan_whose_run_failed_is_passed_over_for_the_next():
    found = distinct(plans({"uniform": 20.0, "params": 40.0}))
    after = decide(found, [Trial(found[0].key, 20.0, None)])
    assert after.candidate is found[1] and "not failed" in after.reason
    assert decide(found, [Trial(c.key, 1.0, None) for c in found]).candidate is None


def test_no_plan_means_stop():
    assert decide([], []).candidate is None


def test_runs_of_one_plan_are_pooled_and_the_noise_is_the_median_standard_error():
    a = Trial(("a",), 10.0, 100.0, (100.0, 90.0, 110.0, 100.0))
    b = Trial(("a",), 10.0, 104.0, (104.0, 104.0))
    (m,) = pooled([a, b])
    assert m.median_ms == 102.0 and m.runs == 2
    steps = (100.0, 90.0, 110.0, 100.0, 104.0, 104.0)
    mad = statistics.median(abs(x - 102.0) for x in steps)
    assert m.noise == pytest.approx(1.25 * 1.4826 * mad / 102.0 / math.sqrt(6))
    assert median_noise([5.0]) == 0.0


def test_the_two_fastest_within_noise_are_measured_again_and_then_it_goes_on():
    found = distinct(plans({"uniform": 20.0, "params": 21.0, "dp": 40.0}))
    best, runner = found[0], found[1]
    noisy = (20.0, 26.0, 17.0, 23.0, 20.0)          # +-15%: the 5% gap below is within noise
    first = [Trial(best.key, 15.0, 20.0, noisy), Trial(runner.key, 21.0, 21.0, tuple(x * 1.05 for x in noisy))]
    again = decide(found, first)
    assert again.candidate is not None and again.candidate.key == best.key and "re-measured" in again.reason
    # measured twice: no more re-measuring, the next untried runner-up (dp is predicted 90% behind: stop)
    after = decide(found, [*first, Trial(best.key, 15.0, 20.0, noisy)])
    assert after.candidate is not None and after.candidate.key == runner.key and "re-measured" in after.reason
    done = decide(found, [*first, Trial(best.key, 15.0, 20.0, noisy), Trial(runner.key, 21.0, 21.0, noisy)])
    assert done.candidate is None
    # quiet steps: a 5% gap is real, no re-measure
    quiet = (20.0, 20.1, 19.9, 20.0, 20.05)
    sure = [Trial(best.key, 15.0, 20.0, quiet), Trial(runner.key, 21.0, 21.0, tuple(x * 1.05 for x in quiet))]
    assert decide(found, sure).candidate is None
    # the chosen plan is the fastest pooled one
    assert fastest_measured([*first, Trial(best.key, 15.0, 30.0, (30.0, 31.0, 29.0))]).key == runner.key
