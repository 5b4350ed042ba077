"""`hybridpipe autotune` and `partition --refine` on real runs (loopback torchrun), and autotune's
handling of jobs that fail or hang."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.cli import main
from hybridpipe.partitioner.cost.calibration import load_calibration
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.partitioner.refine.tuning import plan_key
from hybridpipe.profiles.format import save_profile
from tests.partitioner.synth import make_profile

ROOT = Path(__file__).resolve().parents[2]
LOCAL2 = {"kind": "cluster", "format": 1, "memory_gb": 4,
          "levels": [{"name": "local", "workers": 2, "bandwidth_gbps": 8, "latency_us": 500}]}


@pytest.fixture
def cluster(tmp_path) -> Path:
    path = tmp_path / "local2.json"
    path.write_text(json.dumps(LOCAL2))
    return path


def torchrun_job(steps_placeholder: bool = True) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "hybridpipe.launch", "--plan", "{plan}", "--steps", "{steps}" if steps_placeholder else "8",
            "--run-dir", "{run_dir}", "--timeout", "60", "--no-progress"]


def test_autotune_needs_a_command_with_the_placeholders(tmp_path, cluster, capsys):
    profile = save_profile(make_profile([(1.0, 2.0, 1000, 1000)] * 3), tmp_path / "p.json")
    base = ["autotune", str(profile), "--cluster", str(cluster), "--steps", "4", "--out", str(tmp_path / "o")]
    assert main(base) == 2
    assert "no job command" in capsys.readouterr().err
    assert main([*base, "--", "torchrun", "--plan", "{plan}"]) == 2
    assert "{run_dir}" in capsys.readouterr().err


@pytest.mark.parametrize("job, code, limit", [("import sys; sys.exit(3)", 3, "2"),
                                               ("import time; time.sleep(60)", 124, "0.5")])   # a hang: 2 x the limit
def test_autotune_reports_jobs_that_fail_or_hang_and_stops_at_its_budget(tmp_path, cluster, capsys, job, code, limit):
    profile = save_profile(make_profile([(1.0, 2.0, 1000, 1000)] * 3), tmp_path / "p.json")
    out = tmp_path / "o"
    rc = main(["autotune", str(profile), "--cluster", str(cluster), "--steps", "4", "--budget", "2", "--out", str(out),
               "--run-timeout", limit, "--", sys.executable, "-c", job, "{plan}", "{run_dir}"])
    assert rc == 1
    report = json.loads((out / "autotune.json").read_text())
    assert report["kind"] == "autotune-report" and report["runs"] == 2 and report["chosen"] is None
    assert [t["exit_code"] for t in report["trials"]] == [code, code]
    assert all(t["measured_ms"] is None and "summary.json" in t["note"] for t in report["trials"])
    assert not (out / "plan.json").exists()


def test_autotune_refines_from_earlier_runs_before_its_first_choice(tmp_path, cluster, capsys):
    """--runs: the first plan is chosen and priced by the model refined from the earlier runs (here a run whose
    nodes computed 3x their profile), not by the profile as given."""
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.search.objective import StageSpec
    from tests.partitioner.synth_runs import synthetic_run
    prof = make_profile([(4.0, 8.0, 1000, 1000)] * 3)
    profile = save_profile(prof, tmp_path / "p.json")
    synthetic_run(prof, load_cluster(cluster), [StageSpec(0, 1, (0,)), StageSpec(2, 4, (1,))], micro_batches=4,
                  node_factor=lambda i: 3.0, write_to=tmp_path / "earlier")

    def first_prediction(*extra: str) -> tuple[float, list]:
        out = tmp_path / f"o{len(extra)}"
        main(["autotune", str(profile), "--cluster", str(cluster), "--steps", "4", "--budget", "1", "--out", str(out),
              *extra, "--", sys.executable, "-c", "import sys; sys.exit(3)", "{plan}", "{run_dir}"])
        report = json.loads((out / "autotune.json").read_text())
        return report["trials"][0]["predicted_ms"], report["earlier_runs"]

    plain, none = first_prediction()
    seeded, named = first_prediction("--runs", str(tmp_path / "earlier"))
    assert none == [] and named == [str(tmp_path / "earlier")]
    assert seeded == pytest.approx(3 * plain, rel=0.1)
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "alexnet-small"])
def test_autotune_end_to_end_on_loopback_keeps_the_fastest_measured_plan(tmp_path, cluster, model):
    profile = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "hybridpipe.cli", "profile", model, "--batch-size", "16", "--repeats", "2",
                    "--quiet", "-o", str(profile)], check=True, cwd=ROOT, timeout=300,
                   env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    out = tmp_path / "tune"
    done = subprocess.run([sys.executable, "-m", "hybridpipe.cli", "autotune", str(profile), "--cluster", str(cluster),
                           "--steps", "8", "--budget", "3", "--out", str(out), "--run-timeout", "150", "--",
                           *torchrun_job()], cwd=ROOT, timeout=600, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "autotune.json").read_text())
    trials = report["trials"]
    assert 1 <= report["runs"] == len(trials) <= 3 and report["stop_reason"]
    measured = {t["run"]: t["measured_ms"] for t in trials if t["measured_ms"] is not None}
    pooled: dict[tuple, list[float]] = {}               # a plan's runs pooled: every steady step
    for t in trials:
        if t["measured_ms"] is not None:
            pooled.setdefault(plan_key(load_plan(t["plan"])), []).extend(t["steps_ms"])
    medians = {k: statistics.median(v) for k, v in pooled.items()}
    chosen = next(t for t in trials if t["run"] == report["chosen"])
    assert measured and medians[plan_key(load_plan(chosen["plan"]))] == min(medians.values()) \
        == report["chosen_measured_ms"]
    assert load_plan(out / "plan.json").stages == load_plan(chosen["plan"]).stages
    assert all(t["why"] and t["predicted_ms"] > 0 for t in trials)
    assert len({t["stages"] + str(t["plan"]) for t in trials}) == len(trials)
    # what it learnt is data: the refined calibration loads, and partition --refine repeats the refinement
    cal = load_calibration(out / "refined" / "calibration.json")
    assert cal.refined and cal.compute_slowdown > 0 and len(cal.refined_from) == len(measured)
    again = subprocess.run([sys.executable, "-m", "hybridpipe.cli", "partition", str(profile), "--cluster",
                            str(cluster), "--refine", *[t["run_dir"] for t in trials if t["measured_ms"]],
                            "--save-refined", str(tmp_path / "again"), "--compare"], cwd=ROOT, timeout=120,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "refined from" in again.stdout and "error after" in again.stdout
    assert load_calibration(tmp_path / "again" / "calibration.json").compute_slowdown == pytest.approx(
        cal.compute_slowdown, rel=1e-6)


def test_an_earlier_run_that_measured_fastest_is_the_plan_chosen(tmp_path, cluster, capsys):
    """--runs with the plan the run ran in its directory: autotune ranks that measurement with its own runs
    (here every run of its own fails), writes the earlier plan as the chosen one and reports it as run -1."""
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.plan import save_plan
    from hybridpipe.partitioner.planner import Request
    from hybridpipe.partitioner.planner import partition as make_plan
    from hybridpipe.partitioner.search.objective import StageSpec
    from tests.partitioner.synth_runs import synthetic_run
    prof = make_profile([(4.0, 8.0, 1000, 1000)] * 3)
    profile = save_profile(prof, tmp_path / "p.json")
    plan = make_plan(prof, load_cluster(cluster), Request(strategy="uniform", stages=2)).plan
    specs = [StageSpec(s.first_node, s.last_node, tuple(s.ranks)) for s in plan.stages]
    synthetic_run(prof, load_cluster(cluster), specs, micro_batches=plan.micro_batches,
                  measured_step_ms=plan.predicted_step_ms, write_to=tmp_path / "earlier")
    save_plan(plan, tmp_path / "earlier" / "plan.json")
    out = tmp_path / "tune"
    code = main(["autotune", str(profile), "--cluster", str(cluster), "--steps", "4", "--budget", "2",
                 "--out", str(out), "--runs", str(tmp_path / "earlier"),
                 "--", sys.executable, "-c", "import sys; sys.exit(3)", "{plan}", "{run_dir}"])
    report = json.loads((out / "autotune.json").read_text())
    assert code == 0 and report["chosen"] == -1 and report["runs"] == 1
    assert report["stop_reason"].startswith("converged")
    assert plan_key(load_plan(out / "plan.json")) == plan_key(plan)
    assert [t["run"] for t in report["trials"]] == [-1, 0]      # its own best plan failed; the earlier stands
    capsys.readouterr()
