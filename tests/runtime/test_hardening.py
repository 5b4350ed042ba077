"""The job-level classes of issue 22, with real processes: launch as a module from any directory,
a check that fails on one rank only, --resume that never starts over silently, hostile checkpoint
files, a non-finite loss (stop, or skip), a port in use, and the rank that died first.
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import MANIFEST, complete_steps, rank_file, sha256_of, stage_file, step_dir
from hybridpipe.runtime.dirlock import LOCK_NAME
from hybridpipe.runtime.failure import FailureGuard
from hybridpipe.runtime.liveness import host_identity
from tests import forked
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import ROOT, Finished, _env, final_weights, launch, max_diff, torchrun
from tests.runtime.rank_procs import launch_main

NAN_DATA = "tests.profiles.user_models:nan_after[n=64,start=16,stop=24]"     # step 2 of 8-sample steps


def _lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def one_rank(args: list[str], *, timeout: float = 120, env: dict | None = None) -> Finished:
    """``python -m hybridpipe.launch ARGS`` as a job of one (no torchrun), as a process forked from
    the session's warm fork server (tests/forked.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        alone = _env({"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, **(env or {})})
        proc = forked.start(launch_main, (args,), env=alone, argv=[str(ROOT / "hybridpipe" / "launch.py"), *args],
                            cwd=str(ROOT), stdout=str(out), stderr=str(err))
        try:
            code = proc.wait(timeout)
        finally:
            proc.kill()
        return Finished(0, code, out.read_text(), err.read_text())


def snapshot(root: Path, *, lock: bool = False) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time (to prove nothing changed);
    the job's lock (runtime/dirlock.py: who runs there) only with ``lock``."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and (lock or p.name != LOCK_NAME)}


# ---- launch ships with the package ---------------------------------------------------------------
def _checkouts_package_is_found_from(directory: Path) -> None:
    where = "import importlib.util as u; print(u.find_spec('hybridpipe').origin)"
    found = subprocess.run([sys.executable, "-c", where], cwd=directory, env=_env(), capture_output=True, text=True,
                           timeout=60)
    assert Path(found.stdout.strip()) == ROOT / "hybridpipe" / "__init__.py", found


@pytest.mark.filterwarnings("ignore:'hybridpipe.launch' found in sys.modules:RuntimeWarning")    # imported here
def test_the_checkouts_package_and_both_launch_entries_from_a_directory_outside_the_repository(tmp_path, capsys,
                                                                                              monkeypatch):
    """A new interpreter in another directory finds the checkout's package (PYTHONPATH, as every job of
    the tests has it), not whatever hybridpipe is installed; ``launch.py`` and ``-m hybridpipe.launch``
    both run launch's main (their ``--help`` here, in this process). A whole torchrun job of ``-m
    hybridpipe.launch`` from there: the test below (slow); torchrun's job: test_preempt.py."""
    _checkouts_package_is_found_from(tmp_path)
    monkeypatch.chdir(tmp_path)
    for run in (lambda: runpy.run_path(str(ROOT / "launch.py"), run_name="__main__"),
                lambda: runpy.run_module("hybridpipe.launch", run_name="__main__", alter_sys=True)):
        monkeypatch.setattr(sys, "argv", ["launch", "--help"])
        with pytest.raises(SystemExit) as stop:
            run()
        assert stop.value.code == 0 and "--plan" in capsys.readouterr().out


@pytest.mark.slow           # a torchrun job (new interpreters): torchrun's own runs in test_preempt.py
def test_torchrun_module_launch_from_a_directory_outside_the_repository(tmp_path):
    """``-m hybridpipe.launch`` from another directory: the checkout's package (PYTHONPATH, as every
    job of the tests has it), not whatever hybridpipe is installed in the environment."""
    _checkouts_package_is_found_from(tmp_path)
    plan = tmp_path / "plan.json"
    save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), plan)    # one worker: ~4 s of CPU each
    done = torchrun(["--plan", "plan.json", "--steps", "2", "--run-dir", "run", "--no-progress"], 1,
                    entry=["-m", "hybridpipe.launch"], cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done
    assert "hybridpipe: 2 steps of mlp" in done.stdout, done
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_run"] == 2


# ---- launch fails before the job starts ------------------------------------------------------------
def test_a_problem_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    save_plan(make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    (tmp_path / "a_file").write_text("")
    t0 = time.monotonic()
    ranks = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "2", "--no-progress", "--timeout", "60"], 2,
                   rank_args=lambda r: ["--run-dir", str(tmp_path / "a_file" if r == 1 else tmp_path / "run")])
    seconds = time.monotonic() - t0
    assert [r.returncode for r in ranks] == [2, 2], ranks
    assert _lines(ranks[0].stderr) == [f"hybridpipe.launch: error: argument --run-dir: cannot write to "
                                       f"{tmp_path / 'a_file'}: it is a file, not a directory "
                                       "(see hybridpipe.launch --help)"], ranks
    assert ranks[1].stderr == "", ranks         # the same line, printed once per host (by local rank 0)
    assert not (tmp_path / "run").exists() and seconds < 30, seconds


# ---- --resume never starts over silently ----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A job of one that wrote checkpoints step-1 and step-2 of plan.json."""
    base = tmp_path_factory.mktemp("resume")
    save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), base / "plan.json")
    save_plan(make_plan("mlp", [], [1], micro_batches=4, batch_size=4), base / "other.json")
    done = one_rank(["--plan", str(base / "plan.json"), "--steps", "2", "--checkpoint-dir", str(base / "ckpt"),
                     "--checkpoint-every", "1", "--run-dir", str(base / "run"), "--no-progress"])
    assert done.returncode == 0, done
    assert complete_steps(base / "ckpt") == [1, 2]
    return base, base / "ckpt"


def _copy(root: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(root, to)
    return to


def _resume(base: Path, ckpt: Path, plan: str = "plan.json", *extra: str) -> Finished:
    return one_rank(["--plan", str(base / plan), "--resume", "--steps", "4", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "1", "--keep-checkpoints", "1", "--run-dir", str(base / "run2"),
                     "--no-progress", *extra])


def test_a_fresh_run_never_writes_into_checkpoints_it_did_not_make(trained, tmp_path):
    base, ckpt = trained
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    before = snapshot(ckpt)
    done = one_rank(["--plan", str(base / "plan.json"), "--checkpoint-dir", str(ckpt), "--run-dir",
                     str(tmp_path / "r")])
    assert done.returncode == 2 and _lines(done.stderr) == [
        f"hybridpipe.launch: error: --checkpoint-dir {ckpt} already holds checkpoints (step-000001, step-000002); "
        "continue them with --resume, or pass an empty --checkpoint-dir to start afresh"], done
    assert snapshot(ckpt) == before


def test_resume_with_another_global_batch_is_refused_and_nothing_changes(trained, tmp_path):
    base, ckpt = trained
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    before = snapshot(ckpt)
    done = _resume(base, ckpt, "other.json")
    assert done.returncode == 2, done
    assert _lines(done.stderr) == [f"hybridpipe.launch: error: --resume: {step_dir(ckpt, 2)} was written with global "
                                   "batch 8 (2 micro-batches x 4), not 16 (4 x 4): a checkpoint resumes at its own "
                                   "global batch (keep micro-batches x micro-batch size); nothing was loaded or "
                                   "changed"], done
    assert snapshot(ckpt) == before


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_skips_a_corrupt_checkpoint_names_it_and_never_deletes_it(trained, tmp_path):
    base, ckpt = trained
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    _flip(step_dir(ckpt, 2) / stage_file(0))
    done = _resume(base, ckpt)
    assert done.returncode == 0, done
    assert (f"hybridpipe: --resume: continuing from {step_dir(ckpt, 1)} (step 1) (skipped: step-000002: rank 0: "
            f"checkpoint file {stage_file(0)} is corrupt") in done.stdout, done
    names = sorted(p.name for p in ckpt.iterdir() if p.name != LOCK_NAME)
    # keep 1 of this training's own: step-4; the corrupt step-2 was moved aside (never deleted, never reused)
    assert names == ["step-000002.skipped-1", "step-000004"], names
    assert json.loads((base / "run2" / "summary.json").read_text())["first_step"] == 1


def test_resume_with_every_checkpoint_corrupt_stops_naming_each(trained, tmp_path):
    base, ckpt = trained
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    for step in (1, 2):
        _flip(step_dir(ckpt, step) / rank_file(0))
    (ckpt / "step-000003").mkdir()                        # a save killed by an older hybridpipe: no manifest
    before = snapshot(ckpt)
    done = _resume(base, ckpt)
    assert done.returncode == 2, done
    [line] = _lines(done.stderr)
    assert line == (f"hybridpipe.launch: error: --resume: no usable checkpoint in {ckpt} (step-000003: incomplete "
                    "(no manifest.json: its save was cut short); step-000002: rank 0: checkpoint file rank-00000.pt "
                    "is corrupt (its SHA-256 differs from the manifest's); step-000001: rank 0: checkpoint file "
                    "rank-00000.pt is corrupt (its SHA-256 differs from the manifest's)); repair or move them away, "
                    "or start afresh with another --checkpoint-dir (nothing was changed)"), line
    assert snapshot(ckpt) == before


def test_resume_in_an_empty_directory_starts_afresh_and_says_so(trained, tmp_path):
    base, _ = trained
    done = _resume(base, tmp_path / "new")
    assert done.returncode == 0, done
    assert f"hybridpipe: --resume: no checkpoint in {tmp_path / 'new'} yet; starting from step 0" in done.stdout


def test_a_hostile_shard_stops_resume_and_never_runs(trained, tmp_path):
    base, ckpt = trained
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    path = step_dir(ckpt, 2) / rank_file(0)
    path.write_bytes(pickle.dumps({"rng": _Command(f"touch {marker}")}))
    manifest = json.loads((step_dir(ckpt, 2) / MANIFEST).read_text())
    manifest["files"][rank_file(0)] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    (step_dir(ckpt, 2) / MANIFEST).write_text(json.dumps(manifest))
    done = _resume(base, ckpt)
    assert done.returncode == 2, done
    [line] = _lines(done.stderr)
    assert line.startswith(f"hybridpipe.launch: error: --resume: checkpoint file {path} is not plain tensor data and "
                           "was not loaded"), line
    assert not marker.exists()


class _Command:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


# ---- a non-finite loss ---------------------------------------------------------------------------
@pytest.fixture
def two_stages(tmp_path) -> Path:
    plan = make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    return tmp_path


def _nan_job(base: Path, *extra: str) -> list[Finished]:
    return launch(["--plan", str(base / "plan.json"), "--steps", "4", "--dataset", NAN_DATA, "--lr", "0.05",
                   "--checkpoint-dir", str(base / "ckpt"), "--checkpoint-every", "1", "--run-dir", str(base / "run"),
                   "--no-progress", "--seed", "1", *extra], 2, timeout=120)


def reference(steps: int, skip: set[int], lr: float = 0.05, momentum: float = 0.9) -> dict[str, torch.Tensor]:
    """Single-process SGD on the same data, leaving out the optimizer step of the steps in ``skip``."""
    spec = resolve_model("mlp")
    torch.manual_seed(1)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    data = MicroBatches(resolve_dataset(NAN_DATA, spec, size=64, seed=1), 4, 2)
    for k in range(steps):
        if k in skip:
            continue
        x, y = data.global_batch(k)
        opt.zero_grad()
        spec.loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def test_a_nan_loss_stops_every_rank_at_that_step_and_saves_none_of_it(two_stages):
    ranks = _nan_job(two_stages)
    assert [r.returncode for r in ranks] == [2, 2], ranks
    assert _lines(ranks[0].stderr) == [
        "hybridpipe.launch: error: training stopped: the loss is nan at step 2 (stage 1, micro-batch 0); no weight "
        f"of that step was applied, and none saved; the newest checkpoint in {two_stages / 'ckpt'} is the last good "
        "one; lower --lr, check the data, or pass --skip-nonfinite to skip such steps"], ranks
    assert ranks[1].stderr == "", ranks
    assert sorted(p.name for p in (two_stages / "ckpt").iterdir() if p.name != LOCK_NAME) == ["step-000001",
                                                                                              "step-000002"]
    assert max_diff(final_weights(two_stages / "ckpt", 2), reference(2, set())) <= 1e-5


def test_skip_nonfinite_skips_the_step_on_every_rank_and_counts_it(two_stages):
    ranks = _nan_job(two_stages, "--skip-nonfinite")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    summary = json.loads((two_stages / "run" / "summary.json").read_text())
    assert summary["skipped_nonfinite_steps"] == [2]
    assert "skipped 1 step(s) whose loss was not finite (no weights changed): 2" in ranks[1].stdout, ranks
    assert max_diff(final_weights(two_stages / "ckpt", 4), reference(4, {2})) <= 1e-5


# ---- torchrun's port in use ----------------------------------------------------------------------
def test_a_port_in_use_names_the_port_and_how_to_pick_another(tmp_path):
    save_plan(make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = one_rank(["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--timeout", "5"],
                        env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": None}, timeout=60)
    assert done.returncode == 2, done
    assert _lines(done.stderr) == [f"hybridpipe.launch: error: port {port} on 127.0.0.1 (the job's rendezvous store) "
                                   "is already in use by another program or job; pick a free one with torchrun "
                                   "--master-port P (or --rdzv-endpoint HOST:P), or use torchrun --standalone, which "
                                   "picks one itself"], done


# ---- the rank that died first ----------------------------------------------------------------------
def test_the_rank_that_died_without_a_word_is_named_not_the_one_stopped_after_it():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    guard = FailureGuard(store, rank=0, world_size=4, timeout=5.0, namespace="t")
    sleepers = {r: subprocess.Popen(["sleep", "60"]) for r in (1, 2, 3)}
    try:
        for r, p in sleepers.items():
            guard._store.set(f"who/{r}", json.dumps({"host": host_identity(), "pid": p.pid}))
            guard._store.add(f"hb/{r}", 1)
        assert guard._peers.lost_local(guard._store) is None           # learns the peers and their heartbeats
        time.sleep(0.05)
        guard._store.add("hb/3", 1)                                # rank 3 still beats; ranks 1 and 2 fell silent
        assert guard._peers.lost_local(guard._store) is None
        for p in sleepers.values():                                # ... then all three are gone at one check
            p.send_signal(signal.SIGKILL)
            p.wait()
        guard._store.set("exit/1", json.dumps({"code": 143, "time": time.time()}))   # 1 left through its guard
        first = guard._peers.lost_local(guard._store)
        assert first is not None and first.rank == 2 and "without a word" in first.reason, first
    finally:
        for p in sleepers.values():
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_a_frozen_replica_is_named_within_the_shorter_timeout(tmp_path):
    """--peer-timeout 1000 with --timeout 4: a SIGSTOPped replica (its peer blocked in their gradient
    all-reduce, which names no rank) is named within seconds, not after 1000 s."""
    save_plan(make_plan("mlp", [3], [2, 1], micro_batches=4, batch_size=4), tmp_path / "plan.json")
    stopped: dict[str, float] = {}

    def freeze(procs):
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "metrics" / "rank-00001.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        procs[1].send_signal(signal.SIGSTOP)
        stopped["at"] = time.monotonic()
        for p in (procs[0], procs[2]):
            p.wait(90)
        stopped["took"] = time.monotonic() - stopped["at"]
        procs[1].kill()

    ranks = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--run-dir", str(tmp_path / "run"),
                    "--no-progress", "--timeout", "4", "--peer-timeout", "1000"], 3, timeout=120, on_start=freeze)
    for r in (ranks[0], ranks[2]):
        assert r.returncode == 75, ranks
        assert "rank 1 (stage 0 replica 1) failed first" in r.stderr, ranks
    assert stopped["took"] < 20, stopped
    print(f"a frozen replica was named {stopped['took']:.1f} s after SIGSTOP (--timeout 4, --peer-timeout 1000)")
