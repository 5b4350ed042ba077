"""Checkpoint, kill, resume with the real worker (launch.py on real processes, gloo, CPU).

One uninterrupted run of STEPS steps is the reference. A second identical run gets one rank
killed with SIGKILL once the checkpoint of step K is complete: every other rank must stop
with EXIT_PEER_LOST naming it. A third run resumes it with ``--resume`` and must end with
exactly (bit for bit) the reference's weights and optimizer state. The reference's checkpoints
also feed ``merge-checkpoint`` (the unsplit model must load them strictly and reproduce the
pipelined run's loss) and its traces feed ``hybridpipe timeline``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import MANIFEST, complete_steps, load_file, stage_file, step_dir
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from hybridpipe.runtime.timeline import PHASES
from tests.pipeline.harness import make_plan
from tests.runtime.rank_procs import ROOT, Job

STEPS, K = 24, 12
PEER_TIMEOUT = 10.0


def worker_args(plan_file: Path, out: Path, *extra: str) -> list[str]:
    """launch.py's arguments of these runs."""
    return ["--plan", str(plan_file), "--steps", str(STEPS), "--seed", "3",
            "--lr", "0.05", "--momentum", "0.9", "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", str(K),
            "--keep-checkpoints", "5", "--run-dir", str(out / "run"), "--timeout", "60",
            "--peer-timeout", str(PEER_TIMEOUT), "--no-progress", *extra]


def run_job(plan_file: Path, out: Path, world: int, *extra: str, kill: int | None = None) -> tuple[list, float | None]:
    """One launch.py job; with ``kill``, that rank gets SIGKILL once step K's checkpoint is complete."""
    killed_at = None
    with Job(None, None, world, launch=worker_args(plan_file, out, *extra)) as job:
        if kill is not None:
            manifest = step_dir(out / "ckpt", K) / MANIFEST
            deadline = time.monotonic() + 300
            while not manifest.exists():
                assert time.monotonic() < deadline and not job.poll(), job.wait(1)
                time.sleep(0.005)
            killed_at = job.kill(kill)
        results = job.wait(timeout=300 if kill is None else 3 * PEER_TIMEOUT)
    return results, killed_at


def full_state(ckpt: Path, step: int, n_stages: int) -> dict[str, torch.Tensor]:
    """Every stage's weights and optimizer state (flattened) of one checkpoint."""
    out = {}
    for k in range(n_stages):
        part = load_file(ckpt, step, stage_file(k))
        out.update({f"model/{n}": t for n, t in part["model"].items()})
        for i, st in part["optimizer"]["state"].items():
            out.update({f"opt/{k}/{i}/{n}": t for n, t in st.items() if isinstance(t, torch.Tensor)})
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different[:5]}"


def kill_and_resume(tmp: Path, schedule: str, victim: int) -> dict:
    """Reference run, killed run, resumed run; returns what the tests look at."""
    plan = make_plan("mlp", [3], [2, 1], schedule=schedule, micro_batches=4, batch_size=4)
    plan_file = tmp / "plan.json"
    save_plan(plan, plan_file)
    ref, _ = run_job(plan_file, tmp / "ref", 3)
    assert all(r.returncode == 0 for r in ref), ref
    killed, killed_at = run_job(plan_file, tmp / "cut", 3, kill=victim)
    resumed, _ = run_job(plan_file, tmp / "cut", 3, "--resume")
    assert all(r.returncode == 0 for r in resumed), resumed
    return {"plan": plan, "ref": tmp / "ref", "cut": tmp / "cut", "killed": killed, "killed_at": killed_at,
            "victim": victim}


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory) -> dict:
    return kill_and_resume(tmp_path_factory.mktemp("resume-1f1b"), "1f1b", victim=1)


def test_a_killed_replica_is_named_by_every_other_rank(one_f_one_b):
    victim, killed_at = one_f_one_b["victim"], one_f_one_b["killed_at"]
    for r in one_f_one_b["killed"]:
        if r.rank == victim:
            assert r.returncode == -9
            continue
        assert r.returncode == EXIT_PEER_LOST, r
        assert "rank 1 (stage 0 replica 1) failed first" in r.stderr, r
        assert "restart with --resume" in r.stderr
    latest = max(r.ended for r in one_f_one_b["killed"] if r.rank != victim) - killed_at
    print(f"every rank stopped {latest:.2f} s after the kill")


def test_resumed_1f1b_run_ends_bitwise_equal_to_the_uninterrupted_one(one_f_one_b):
    cut = one_f_one_b["cut"]
    summary = json.loads((cut / "run" / "summary.json").read_text())
    assert summary["first_step"] == K and summary["steps_run"] == STEPS - K
    assert complete_steps(cut / "ckpt") == [K, STEPS]
    assert_bitwise_equal(full_state(one_f_one_b["ref"] / "ckpt", STEPS, 2), full_state(cut / "ckpt", STEPS, 2))
    ref_loss = json.loads((one_f_one_b["ref"] / "run" / "summary.json").read_text())["loss"]
    assert {int(k): v for k, v in summary["loss"].items()} == {int(k): v for k, v in ref_loss.items() if int(k) >= K}


def test_merged_checkpoint_loads_strictly_and_gives_the_pipelined_loss(one_f_one_b, tmp_path, capsys):
    plan, ref = one_f_one_b["plan"], one_f_one_b["ref"]
    out = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(ref / "ckpt"), "--step", str(K), "-o", str(out)]) == 0
    spec = resolve_model(plan.model)
    model = spec.build()
    model.load_state_dict(torch.load(out), strict=True)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=STEPS * plan.micro_batches * plan.batch_size,
                                        seed=3), plan.batch_size, plan.micro_batches)
    with torch.no_grad():                   # step K's loss is computed with the weights after K steps
        losses = [spec.loss(model(x), y) for x, y in (data.batch(K, m) for m in range(plan.micro_batches))]
    pipelined = json.loads((ref / "run" / "summary.json").read_text())["loss"][str(K)]
    assert abs(float(torch.stack(losses).mean()) - pipelined) <= 1e-6 * abs(pipelined)


def test_timeline_of_the_run_holds_every_rank_and_phase(one_f_one_b, tmp_path, capsys):
    png = tmp_path / "t.png"
    assert main(["timeline", str(one_f_one_b["ref"] / "run"), "-o", str(tmp_path / "t.json"), "--png", str(png)]) == 0
    merged = json.loads((tmp_path / "t.json").read_text())
    ranks = {e["pid"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert ranks == {0, 1, 2}
    assert {e["name"] for e in merged["traceEvents"] if e.get("cat") == "phase"} == set(PHASES)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_resumed_pipedream_run_ends_bitwise_equal_to_the_uninterrupted_one(tmp_path):
    got = kill_and_resume(tmp_path, "pipedream", victim=2)
    assert all(r.returncode == EXIT_PEER_LOST for r in got["killed"] if r.rank != 2), got["killed"]
    summary = json.loads((got["cut"] / "run" / "summary.json").read_text())
    assert summary["first_step"] == K
    assert_bitwise_equal(full_state(got["ref"] / "ckpt", STEPS, 2), full_state(got["cut"] / "ckpt", STEPS, 2))


# ---- torchrun --max-restarts ---------------------------------------------------------------------
def worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the launch.py workers that torchrun's agent ``parent`` started."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            if ppid != parent:
                continue
            env = dict(x.split("=", 1) for x in (proc / "environ").read_text().split("\0") if "=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_torchrun_restarts_the_job_after_a_kill_and_it_ends_like_an_uninterrupted_run(tmp_path, schedule):
    import os
    import signal
    import subprocess

    plan = make_plan("mlp", [3], [2, 1], schedule=schedule, micro_batches=4, batch_size=4)
    plan_file = tmp_path / "plan.json"
    save_plan(plan, plan_file)
    ref, _ = run_job(plan_file, tmp_path / "ref", 3)
    assert all(r.returncode == 0 for r in ref), ref
    out = tmp_path / "restarted"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", "1", "--monitor-interval", "0.2", str(ROOT / "launch.py"),
           *worker_args(plan_file, out, "--resume")]
    # torch 2.13's torchrun shares its rendezvous store with the workers and keeps the gloo
    # addresses of the failed attempt in it: a restarted rank may read a stale one and fail to
    # connect (pytorch/pytorch#135712). A store per attempt avoids that.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(tmp_path / "torchrun.log", "w+") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            manifest = step_dir(out / "ckpt", K) / MANIFEST
            deadline = time.monotonic() + 300
            while not manifest.exists() and time.monotonic() < deadline and agent.poll() is None:
                time.sleep(0.005)
            pids = worker_pids(agent.pid)
            assert manifest.exists() and len(pids) == 3, pids
            os.kill(pids[2], signal.SIGKILL)
            agent.wait(300)
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        log.seek(0)
        text = log.read()
    assert agent.returncode == 0, text
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["first_step"] == K, text          # the restarted workers resumed from the checkpoint
    assert_bitwise_equal(full_state(tmp_path / "ref" / "ckpt", STEPS, 2), full_state(out / "ckpt", STEPS, 2))


# ---- killed in the middle of a checkpoint ---------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_cut_by_a_kill_is_never_resumed_from(tmp_path):
    """Checkpoints every step; a rank is killed while one is being written (its staging directory
    .step-N.tmp exists): no step-N directory is ever torn, and resume takes the newest complete one
    and still ends like the reference."""
    plan = make_plan("mlp", [3], [2, 1], schedule="1f1b", micro_batches=4, batch_size=4)
    plan_file = tmp_path / "plan.json"
    save_plan(plan, plan_file)
    every = ("--checkpoint-every", "1", "--keep-checkpoints", "100")
    ref, _ = run_job(plan_file, tmp_path / "ref", 3, *every)
    assert all(r.returncode == 0 for r in ref), ref
    out = tmp_path / "cut"
    ckpt = out / "ckpt"
    with Job(None, None, 3, launch=worker_args(plan_file, out, *every)) as job:
        deadline = time.monotonic() + 300
        torn = None
        while torn is None:
            assert time.monotonic() < deadline and not job.poll(), job.wait(1)
            if not complete_steps(ckpt, 2):
                continue
            for d in sorted(ckpt.glob(".step-*.tmp")):
                with contextlib.suppress(FileNotFoundError):      # committed (renamed) meanwhile
                    if any(d.iterdir()):
                        torn = d
                        break
        job.kill(0)                                    # rank 0 also writes the manifests
        results = job.wait(timeout=3 * PEER_TIMEOUT)
    assert all(r.returncode == EXIT_PEER_LOST for r in results[1:]), results
    steps = complete_steps(ckpt, 2)
    assert sorted(int(d.name[5:]) for d in ckpt.glob("step-*")) == steps       # never a torn step-N
    resumed, _ = run_job(plan_file, out, 3, *every, "--resume")
    assert all(r.returncode == 0 for r in resumed), resumed
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["first_step"] == steps[-1]
    assert_bitwise_equal(full_state(tmp_path / "ref" / "ckpt", STEPS, 2), full_state(ckpt, STEPS, 2))
