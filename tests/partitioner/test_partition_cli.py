"""`hybridpipe partition` end to end on a profile built here (no profiler, no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridpipe.cli import main
from hybridpipe.commands.partition import rank_ranges
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.profiles.format import save_profile
from tests.partitioner.synth import make_profile

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
LAYERS = [(6.0, 12.0, 3_000_000, 140_000), (4.0, 8.0, 1_000_000, 3_500_000), (0.6, 1.2, 16_000, 150_000_000),
          (0.2, 0.4, 4_000, 16_000_000)]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    return save_profile(make_profile(LAYERS, model="convfc"), tmp_path_factory.mktemp("p") / "convfc.json")


@pytest.mark.parametrize("cluster", sorted(p.name for p in CLUSTERS.glob("*.json")))
def test_every_example_cluster_plans(profile, cluster, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / cluster), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert plan.model == "convfc" and plan.world_size == plan.cluster.total_workers
    header = next(line for line in text.splitlines() if line.startswith("stage"))
    assert header.split()[:4] == ["stage", "nodes", "layers", "replicas"]
    assert f"predicted step {plan.predicted_step_ms:.1f} ms" in text and "data parallel on the same workers" in text
    assert text.count("% *") == 1 and f"wrote {out}" in text


def test_options_reach_the_plan(profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--workers", "4",
                 "--schedule", "pipedream", "--strategy", "time", "--micro-batches", "6", "--optimizer", "adam",
                 "--memory-gb", "2", "--layers", "--compare", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert (plan.world_size, plan.schedule, plan.strategy, plan.micro_batches, plan.optimizer) == \
        (4, "pipedream", "time", 6, "adam")
    assert all(s.replicas == 1 for s in plan.stages) and "no stage is replicated" in text
    for name in ("optimal", "pipedream", "dp", "uniform", "params"):
        assert any(line.startswith(name) for line in text.splitlines())


def test_calibration_and_algorithm_choice(profile, tmp_path, capsys):
    cal = {"kind": "calibration", "format": 1, "world_size": 4, "hosts": 4, "backend": "gloo", "device": "cpu",
           "level": "network", "gamma_s_per_byte": 1e-10, "p2p": {"alpha_s": 1e-4, "beta_s_per_byte": 9e-9},
           "algorithms": {"ring": {"alpha_s": 1e-4, "beta_s_per_byte": 9e-9}}}
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "4x1gbit.json"), "--strategy", "dp",
                 "--calibration", str(tmp_path / "cal.json"), "--algorithms", "ring", "--layers"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.strip().startswith("0  l")]
    assert rows and all(" ring " in line for line in rows) and "not saved" in text


@pytest.mark.parametrize("args,message", [
    (["--workers", "0"], "--workers: must be >= 1, got 0"),
    (["--workers", "9"], "more than the cluster's 4 workers"),
    (["--memory-gb", "0.001"], "no plan fits in 0.001 GB per worker"),
    (["--strategy", "time", "--workers", "4", "--stages", "2"], "replicates nothing"),
    (["--micro-batches", "0"], "--micro-batches: must be >= 1, got 0"),
    (["--algorithms", "smoke-signals"], "--algorithms must name some of"),
])
def test_errors_are_one_line_and_exit_2(profile, args, message, capsys):
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "4x1gbit.json"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("hybridpipe partition: error:")


@pytest.mark.slow
def test_as_a_subprocess(profile, tmp_path):
    """(Default: the real `python -m hybridpipe.cli` exits 2 with one line in test_cli.py.)"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "hybridpipe.cli", "partition", str(profile), "--cluster",
                           str(tmp_path / "nope.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cluster file" in done.stderr and "does not exist" in done.stderr


def test_a_partition_imports_no_torch(profile, tmp_path):
    """The planner is plain Python and numpy: torch's import (~2 CPU s) stays out of `hybridpipe partition`."""
    code = ("import sys; from hybridpipe.cli import main; code = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, "partition", str(profile), "--cluster",
                           str(CLUSTERS / "8x1gbit.json"), "--compare", "-o", str(tmp_path / "plan.json")], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout


def test_compare_prints_every_infeasible_reason_in_full(profile, tmp_path, capsys):
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--compare"]) == 0
    text = capsys.readouterr().out
    # 6 nodes cannot make 8 one-worker stages: uniform, params, time and the layer counts are infeasible, each
    # with its whole reason
    for name in ("uniform", "params", "time", "torchtitan", "megatron"):
        line = next(x for x in text.splitlines() if x.startswith(f"{name} is infeasible: "))
        assert line.endswith("use fewer --workers or --stages, or --strategy optimal")
    assert text.count("infeasible (why: below)") == 5


def test_pipedream_picks_micro_batches_its_replicas_divide(profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--strategy", "pipedream",
                 "--schedule", "pipedream", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert all(plan.micro_batches % s.replicas == 0 for s in plan.stages) and plan.micro_batches >= 16
    assert f"note: --strategy pipedream: {plan.micro_batches} micro-batches per step" in text
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--strategy", "pipedream",
                 "--micro-batches", "16", "-o", str(out)]) == 0
    assert load_plan(out).micro_batches == 16


def test_time_budget_keeps_the_best_plan_and_records_how_far_it_may_be(profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--time-budget", "1e-9",
                 "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert "search: stopped after" in text and "raise --time-budget to close the gap" in text and plan.stages
    assert plan.search is not None and not plan.search.complete and plan.search.budget_s == 1e-9
    assert plan.search.lower_bound_ms <= plan.search.objective_ms
    assert (plan.search.gap is None) == (plan.search.lower_bound_ms == 0)
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--time-limit", "1e-9",
                 "-q"]) == 0                                        # the old name of the option
    assert "search: stopped after" in capsys.readouterr().out
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--time-budget", "0"]) == 2
    assert "--time-budget/--time-limit: must be greater than 0" in capsys.readouterr().err


def test_every_search_has_a_default_budget_and_the_plan_records_its_end(profile, tmp_path, capsys):
    from hybridpipe.partitioner.planner import DEFAULT_TIME_BUDGET_S
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "-q", "-o", str(out)]) == 0
    search = load_plan(out).search
    assert search is not None and search.complete and search.budget_s == DEFAULT_TIME_BUDGET_S
    assert search.gap == 0 and search.lower_bound_ms == search.objective_ms
    assert f"search: the optimum (searched to the end in {search.seconds:.2f} s of the 120 s" in capsys.readouterr().out
    assert main(["show", str(out)]) == 0 and "search: the optimum" in capsys.readouterr().out
    for strategy, extra in (("pipedream", []), ("params", ["--stages", "2"])):   # their searches stop too
        assert main(["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json"), "--strategy", strategy,
                     "--time-budget", "1e-9", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--strategy {strategy} did not finish within --time-budget 1e-09 s" in err[0], err


def test_progress_bar_on_stderr_unless_quiet(profile, capsys, monkeypatch):
    from hybridpipe.commands import partition as command
    monkeypatch.setattr(command, "SHOW_AFTER_S", 0.0)          # as if the search took more than a second
    args = ["partition", str(profile), "--cluster", str(CLUSTERS / "8x1gbit.json")]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "optimal:" in captured.err and "ms/step]" in captured.err and "optimal:" not in captured.out
    assert main([*args, "-q"]) == 0
    assert capsys.readouterr().err == ""


@given(st.sets(st.integers(0, 40)))
def test_rank_ranges_lists_every_rank_once_in_maximal_runs(ranks):
    """``rank_ranges`` read back: the same ranks in order, and no two runs that touch (each run maximal)."""
    text = rank_ranges(ranks)
    runs = [tuple(map(int, p.split("-"))) if "-" in p else (int(p), int(p)) for p in text.split(",")] if text else []
    assert [r for a, b in runs for r in range(a, b + 1)] == sorted(ranks)
    assert all(a <= b for a, b in runs) and all(b + 1 < a2 for (_, b), (a2, _) in pairwise(runs))
