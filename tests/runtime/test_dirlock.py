"""One job per checkpoint directory (runtime/dirlock.py): the rule on plain records, the lock with
real processes holding it, and two launch.py jobs on one directory."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.dirlock import LOCK_NAME, DirLock, Holder, SaveLocks, judge
from tests import forked
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import ROOT, _env
from tests.runtime.rank_procs import launch_main
from tests.runtime.test_hardening import _lines, one_rank, snapshot

ME = Holder("run-a", 1, "host-a/boot/1", "a", 100, 0.0)


def _holder(**changes) -> Holder:
    return dataclasses.replace(ME, **changes)


def alive(*pids: int):
    return lambda pid: pid in pids


# ---- the rule (pure) ---------------------------------------------------------------------------
def test_a_free_lock_is_taken_silently_and_a_stale_record_is_named():
    assert judge(None, ME, held=False, alive=alive()) == (True, "")
    assert judge(_holder(restart=0, pid=7), ME, held=False, alive=alive()) == (True, "")   # our earlier attempt
    ok, line = judge(_holder(run_id="run-b", pid=7), ME, held=False, alive=alive(7))
    assert ok and line.startswith("took over the lock of run id run-b, host a, pid 7, since ") and \
        line.endswith("that job ended without releasing it")


def test_a_held_lock_is_another_jobs_unless_its_holder_is_gone_or_an_earlier_attempt_of_this_run():
    other = _holder(run_id="run-b", restart=0, pid=7)
    assert judge(other, ME, held=True, alive=alive(7)) == (False, f"in use by another job ({other.describe()})")
    ok, line = judge(other, ME, held=True, alive=alive())                        # pid 7 gone from this host
    assert ok and "its process is gone from this host" in line
    far = _holder(host="host-b/boot/1", pid=7, restart=0)
    assert not judge(dataclasses.replace(far, run_id="run-b"), ME, held=True, alive=alive())[0]   # can't see it
    assert judge(far, ME, held=True, alive=alive())[0]                           # attempt 0 of run-a, on a dead host
    assert not judge(dataclasses.replace(far, restart=1), ME, held=True, alive=alive())[0]   # the same attempt: a twin
    assert not judge(_holder(run_id="", restart=0), dataclasses.replace(ME, run_id=""), held=True, alive=alive(100))[0]
    assert judge(None, ME, held=True, alive=alive())[0] is False                # a job that is just starting


# ---- real processes holding it -----------------------------------------------------------------
HOLD = """
import os, sys, time
from hybridpipe.runtime.dirlock import DirLock, Holder
lock, note = DirLock.acquire(sys.argv[1], Holder.here())
if sys.argv[2] == "fork" and os.fork() == 0:       # a child that inherits the locked file and outlives us
    time.sleep(float(sys.argv[3]))
    os._exit(0)
print("held", flush=True)
time.sleep(600)
"""


def _hold(root: Path, mode: str = "plain", child_s: float = 0.0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(root), mode, str(child_s)], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_lock_held_by_a_live_process_is_refused_and_taken_over_once_it_is_killed(tmp_path):
    holder = _hold(tmp_path)
    try:
        with pytest.raises(UserError, match=rf"^--checkpoint-dir {tmp_path} is in use by another job \(host "
                                            rf"\S+, pid {holder.pid}, since .*\): two jobs must never write"):
            DirLock.acquire(tmp_path, Holder.here())
        record = (tmp_path / LOCK_NAME).read_text()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        t0 = time.perf_counter()
        lock, note = DirLock.acquire(tmp_path, Holder.here())
        took = time.perf_counter() - t0
    finally:
        holder.kill()
        holder.wait(10)
    assert json.loads(record)["pid"] == holder.pid
    assert note.startswith(f"took over the lock of host {os.uname().nodename}, pid {holder.pid}, since "), note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    print(f"lock taken over {took * 1000:.1f} ms after its holder was killed")
    assert took < 1.0
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""
    again, note = DirLock.acquire(tmp_path, Holder.here())            # a clean release: no line
    assert note == ""
    again.release()


def test_a_dead_holder_whose_child_keeps_the_lock_is_taken_over_and_claimed_when_the_child_exits(tmp_path):
    holder = _hold(tmp_path, "fork", 0.5)
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    lock, note = DirLock.acquire(tmp_path, Holder.here())
    try:
        assert "its process is gone from this host" in note, note
        assert not lock.claimed.is_set()                        # the child still has the flock
        with pytest.raises(UserError, match="in use by another job"):     # but the record names this process
            DirLock.acquire(tmp_path, Holder("", 0, "elsewhere", "b", 1, 0.0))
        assert lock.claimed.wait(20)                            # the child exited: the flock is ours
        fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        lock.release()


# ---- the Trainer's saves (one process, no process group) -------------------------------------------
def test_a_trainers_first_save_locks_and_refuses_checkpoints_it_did_not_load(tmp_path):
    """SaveLocks (Trainer.save): a directory holding another run's step is refused, nothing locked;
    once loaded it is continued; while one holds it a second is refused; release lets go."""
    (tmp_path / "step-000002").mkdir()
    first = SaveLocks(0)
    with pytest.raises(UserError, match=r"already holds checkpoints \(step-000002\); trainer.load\(it\) first"):
        first.before_save(tmp_path)
    assert first.locks == {} and (tmp_path / LOCK_NAME).read_text() == ""
    first.loaded(tmp_path)
    first.before_save(tmp_path)
    first.before_save(tmp_path)                          # once per directory
    second = SaveLocks(0)
    second.loaded(tmp_path)
    with pytest.raises(UserError, match="is in use by another job"):
        second.before_save(tmp_path)
    first.release()
    second.before_save(tmp_path)
    second.release()
    assert SaveLocks(0, held=tmp_path).locks == {str(tmp_path.resolve()): None}    # launch's: not locked again


# ---- two jobs on one directory -----------------------------------------------------------------
def test_a_second_job_on_the_same_checkpoint_dir_is_refused_and_touches_nothing(tmp_path):
    save_plan(make_plan("mlp", [], [1], micro_batches=2, batch_size=4), tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"

    def args(run: str, steps: int, every: int) -> list[str]:
        return ["--plan", str(tmp_path / "plan.json"), "--steps", str(steps), "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", str(every), "--resume", "--run-dir", str(tmp_path / run), "--no-progress"]

    first = forked.start(launch_main, (args("a", 10**6, 5),), env=_env({"RANK": None, "WORLD_SIZE": None,
                                                                        "LOCAL_RANK": None}),
                         argv=[str(ROOT / "hybridpipe" / "launch.py"), *args("a", 10**6, 5)], cwd=str(ROOT),
                         stdout=os.devnull, stderr=str(tmp_path / "first.err"))
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("step-*")):        # the first job holds the lock and has written a step
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "first.err").read_text()
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)           # frozen, holding the lock: nothing changes under the snapshot
        before = snapshot(ckpt, lock=True)
        second = one_rank(args("b", 2, 1))
        assert snapshot(ckpt, lock=True) == before
        assert second.returncode == 2, second
        [line] = _lines(second.stderr)
        assert line.startswith(f"hybridpipe.launch: error: --checkpoint-dir {ckpt} is in use by another job (host "
                               f"{os.uname().nodename}, pid {first.pid}, since "), line
        assert not (tmp_path / "b").exists()
        first.send_signal(signal.SIGKILL)           # a job that dies keeps no lock: the next one takes it over
        first.wait(10)
        third = one_rank(args("c", 2, 1))
    finally:
        first.kill()
        first.wait(10)
    assert third.returncode == 0, third
    assert f"hybridpipe: took over the lock of host {os.uname().nodename}, pid {first.pid}" in third.stderr, third
    assert "hybridpipe: --resume: continuing from" in third.stdout, third
    assert (ckpt / LOCK_NAME).read_text() == ""     # released at the end
