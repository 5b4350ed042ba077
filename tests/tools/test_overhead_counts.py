"""overhead.py's paired spread (overhead_stats.py) and its counting of Python calls and aten ops
per kind of instruction (overhead_counts.py), in-process (well under a second)."""

from __future__ import annotations

import statistics
import threading

import numpy as np
import pytest
import torch

from benchmarks.overhead import per_counts
from benchmarks.overhead_counts import Counts
from benchmarks.overhead_probes import Tally, run_steps
from benchmarks.overhead_stats import bootstrap_median, paired, quantile, ratio_summary


@pytest.mark.parametrize("xs", [[3.0], [1.0, 2.0], [0.9, 1.3, 0.7, 1.1, 2.5], list(np.linspace(0.1, 4.0, 17))])
def test_quantiles_are_numpys(xs):
    for q in (0.0, 0.25, 0.5, 0.75, 1.0):
        assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))


def test_the_interval_holds_the_median_and_the_verdict_needs_it_clear_of_one():
    lo, hi = bootstrap_median([0.8, 0.9, 0.85, 0.95, 0.7, 0.9])
    assert lo <= statistics.median([0.8, 0.9, 0.85, 0.95, 0.7, 0.9]) <= hi < 1
    assert ratio_summary([0.8, 0.9, 0.85, 0.95, 0.7, 0.9])["verdict"] == "lighter"
    assert ratio_summary([1.2, 1.1, 1.3, 1.05])["verdict"] == "heavier"
    assert ratio_summary([0.7, 1.3, 0.9, 1.2, 1.0])["verdict"] == "not separated"


def test_pairs_are_taken_round_by_round():
    ours = [{"x": 1.0}, {"x": 3.0}, {"x": None}]
    theirs = [{"x": 2.0}, {"x": 2.0}, {"x": 5.0}]
    got = paired(ours, theirs, {"x": lambda r: r["x"]})
    assert got["x"]["ratios"] == [0.5, 1.5]


def _counted(steps: int) -> dict:
    """run_steps with counts over a toy system: per step two probed forwards (a helper: one Python
    call, two aten ops), a probed step (one aten op), and on step 2 a thread started after install
    calling the helper 5 times."""
    tally = Tally()
    counts = Counts(tally)
    x = torch.ones(3)

    def helper(t):
        return (t + 1) * 2

    forward = tally.probe("forward", lambda: helper(x))
    step = tally.probe("step", lambda: x.sum())
    counts.install()
    try:
        t = threading.Thread(target=lambda: [helper(x) for _ in range(5)])

        def one(k):
            forward()
            forward()
            step()
            if k == 2:
                t.start()
                t.join()
        return run_steps(one, steps=steps, warmup=2, tally=tally, counts=counts)["calls"]
    finally:
        counts.uninstall()


def test_python_calls_are_counted_by_the_kind_whose_probe_runs_and_other_threads_as_background():
    got = _counted(steps=3)         # one measured step: the Python calls' (no dispatch mode, so fast)
    assert got["steps"] == {"calls": 1, "ops": 0} and got["aten_ops"] == {}
    assert got["function_names"]["forward:test_overhead_counts.py:helper"] == 2
    assert got["function_names"]["forward:test_overhead_counts.py:<lambda>"] == 2
    assert got["python_calls"]["forward"] == 4                     # the probed lambda and helper, twice
    assert got["function_names"]["background:test_overhead_counts.py:helper"] == 5
    assert got["function_names"]["step:test_overhead_counts.py:<lambda>"] == 1
    # the probes' and hooks' own calls are the benchmark's, not a system's
    assert not any(k.split(":")[1] in ("overhead_probes.py", "overhead_counts.py") for k in got["function_names"])


@pytest.mark.slow       # the first TorchDispatchMode a process enters imports torch._dynamo (~5-12 s)
def test_aten_ops_are_counted_on_the_other_steps_and_per_counts_divides_by_each():
    got = _counted(steps=4)         # step 2 counts calls, step 3 aten ops
    assert got["steps"] == {"calls": 1, "ops": 1}
    assert got["aten_ops"] == {"forward": 4, "step": 1}
    assert got["aten_op_names"] == {"forward:add": 2, "forward:mul": 2, "step:sum": 1}
    rank = {"steps": 2, "count": {"forward": 4.0, "step": 2.0}, "calls": got}
    out = per_counts([rank, rank])
    assert out["per_instruction"]["aten_ops"]["forward"] == pytest.approx(2.0)   # 8 ops / 4 forwards a step
    assert out["per_step"]["aten_ops"]["all"] == pytest.approx(10.0)
    assert out["per_instruction"]["python_calls"]["forward"] == pytest.approx(2.0)
