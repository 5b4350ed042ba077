"""Failure handling (hybridpipe/runtime/failure.py) with real rank processes.

A toy pipeline (ranks 0 and 1: stage 0 replicas that all-reduce; rank 2: stage 1; rank 3:
stage 2) moves tensors through real p2p Channels and a real gloo all-reduce under the
FailureGuard; one rank is killed with SIGKILL and every other rank must exit with
EXIT_PEER_LOST within the timeout, naming the killed rank. The rank programs are the
functions at the bottom of this file (each child loads it by path).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridpipe.comm.p2p.errors import P2PTimeout, PeerLost
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.runtime.failure import (
    EXIT_ERROR,
    EXIT_PEER_LOST,
    Failure,
    FailureGuard,
    default_store,
    describe_ranks,
    suspect_of,
)
from hybridpipe.runtime.liveness import host_identity, process_alive

HERE = Path(__file__).resolve()
TIMEOUT, INTERVAL = 6.0, 0.2


def toy_plan() -> Plan:
    cluster = Cluster(levels=(Level("node", 4, 100.0),), memory_gb=1.0)
    return Plan(model="mlp", batch_size=4, input_shape=(4, 64), profile_signature="toy", cluster=cluster,
                strategy="optimal", schedule="1f1b", micro_batches=2, optimizer="sgd",
                stages=(Stage(0, 0, 2, 2, (0, 1)), Stage(1, 3, 5, 1, (2,)), Stage(2, 6, 10, 1, (3,))))


# ---- unit tests (no processes) ---------------------------------------------------------------
def test_suspects_are_read_from_the_exception():
    assert suspect_of(PeerLost(3, "recv 'act/1'", "gone")) == (3, "lost")
    assert suspect_of(P2PTimeout(2, "recv 'grad/0'", "slow")) == (2, "stalled")
    gloo = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer. This is typically")
    assert suspect_of(gloo) == (None, "collective")
    assert suspect_of(ValueError("bad shape")) == (None, "own")
    assert suspect_of(UserError("no such file")) == (None, "own")


def test_failure_record_round_trips_and_ranks_are_described():
    f = Failure(2, "its process 123 is gone", 1)
    assert Failure.from_bytes(f.to_bytes()) == f
    describe = describe_ranks(toy_plan())
    assert describe(1) == "rank 1 (stage 0 replica 1)" and describe(3) == "rank 3 (stage 2 replica 0)"
    assert describe(9) == "rank 9"


def test_process_alive_sees_zombies_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:      # exited but not reaped: a zombie, like a killed rank
        if not process_alive(child.pid):
            break
        time.sleep(0.01)
    assert not process_alive(child.pid)
    assert os.waitpid(child.pid, 0)[0] == child.pid
    assert process_alive(os.getpid())
    assert host_identity() == host_identity()


def test_first_report_wins_on_a_real_store():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    a = FailureGuard(store, rank=0, world_size=2, timeout=5, namespace="t")
    b = FailureGuard(store, rank=1, world_size=2, timeout=5, namespace="t")
    assert a.published() is None
    first = a.report(Failure(1, "gone", 0))
    assert b.report(Failure(0, "other story", 1)) == first == b.published()
    other = FailureGuard(store, rank=0, world_size=2, timeout=5, namespace="t2")   # another restart
    assert other.published() is None


# ---- real processes ---------------------------------------------------------------------------
def _run_and_kill(program: str, world: int, victim: int, tmp: Path) -> tuple[list, float]:
    from tests.runtime.rank_procs import Job

    with Job(HERE, program, world, (TIMEOUT, INTERVAL, str(tmp))) as job:
        deadline = time.monotonic() + 120
        while job.store.add("ready", 0) < world:
            assert time.monotonic() < deadline and not job.poll(), f"ranks did not start: {job.wait(1)}"
            time.sleep(0.05)
        killed_at = job.kill(victim)
        results = job.wait(timeout=TIMEOUT * 3)
    return results, killed_at


def _check_everyone_named(results, victim: int, killed_at: float, describe) -> float:
    assert results[victim].returncode == -signal.SIGKILL
    latest = 0.0
    for r in results:
        if r.rank == victim:
            continue
        assert r.returncode == EXIT_PEER_LOST, r
        assert f"{describe(victim)} failed first" in r.stderr, r
        assert r.stderr.strip().count("\n") == 0, f"more than one line: {r}"
        latest = max(latest, r.ended - killed_at)
    return latest


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2])
def test_killed_rank_is_named_by_every_other_rank(victim, tmp_path):
    results, killed_at = _run_and_kill("toy_pipeline", 4, victim, tmp_path)
    latest = _check_everyone_named(results, victim, killed_at, describe_ranks(toy_plan()))
    assert sorted(p.name for p in tmp_path.glob("exit-*")) == [f"exit-{r}" for r in range(4) if r != victim]
    print(f"all ranks stopped {latest:.2f} s after rank {victim} was killed")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1, 2, 3])
@pytest.mark.parametrize("attempt", range(10))
def test_killed_rank_is_named_repeatedly(victim, attempt, tmp_path):
    results, killed_at = _run_and_kill("toy_pipeline", 4, victim, tmp_path)
    _check_everyone_named(results, victim, killed_at, describe_ranks(toy_plan()))


def test_ranks_blocked_in_an_all_reduce_name_the_killed_rank(tmp_path):
    results, killed_at = _run_and_kill("all_reduce_loop", 3, 1, tmp_path)
    latest = _check_everyone_named(results, 1, killed_at, lambda r: f"rank {r}")
    print(f"ranks blocked in all-reduce stopped {latest:.2f} s after the kill")


@pytest.mark.slow
def test_a_frozen_rank_is_named_after_the_heartbeat_timeout(tmp_path):
    from tests.runtime.rank_procs import Job

    timeout = 3.0
    with Job(HERE, "all_reduce_loop", 3, (timeout, INTERVAL, str(tmp_path))) as job:
        while job.store.add("ready", 0) < 3:
            assert not job.poll(), job.wait(1)
            time.sleep(0.05)
        stopped_at = job.kill(1, signal.SIGSTOP)     # alive but silent: a frozen host looks like this
        deadline = stopped_at + timeout * 5
        while not {0, 2} <= set(job.poll()) and time.monotonic() < deadline:
            time.sleep(0.05)
        job.kill(1, signal.SIGKILL)
        results = job.wait(timeout=10)
    for r in (results[0], results[2]):
        assert r.returncode == EXIT_PEER_LOST, r
        assert "rank 1 failed first" in r.stderr and "no heartbeat" in r.stderr, r
        assert r.ended - stopped_at >= timeout * 0.9, "named before the heartbeat timeout ran out"
    print(f"a frozen rank was named {max(r.ended for r in results if r.rank != 1) - stopped_at:.2f} s after "
          f"it stopped (timeout {timeout} s)")


@pytest.mark.slow
def test_losing_the_store_host_stops_every_rank(tmp_path):
    """The c10d store lives in torchrun's agent (or in rank 0): when it goes, the ranks stop too."""
    import gc

    from tests.runtime.rank_procs import Job

    with Job(HERE, "all_reduce_loop", 3, (TIMEOUT, INTERVAL, str(tmp_path))) as job:
        while job.store.add("ready", 0) < 3:
            assert not job.poll(), job.wait(1)
            time.sleep(0.05)
        store, job.store = job.store, None
        del store               # the store's server shuts down with its last reference
        gc.collect()
        results = job.wait(timeout=TIMEOUT * 3)
    for r in results:
        assert r.returncode == EXIT_PEER_LOST, r
        assert "the c10d store is unreachable" in r.stderr, r


def test_a_rank_that_raises_is_named_with_its_error(tmp_path):
    from tests.runtime.rank_procs import Job

    with Job(HERE, "raise_on_rank", 3, (TIMEOUT, INTERVAL, str(tmp_path))) as job:
        results = job.wait(timeout=60)
    assert results[2].returncode == EXIT_ERROR and "Traceback" in results[2].stderr
    assert "failed: ValueError: stage 2 got a bad batch" in results[2].stderr
    for r in results[:2]:
        assert r.returncode == EXIT_PEER_LOST, r
        assert "rank 2 failed first: ValueError: stage 2 got a bad batch" in r.stderr, r


# ---- rank programs (run in the children by tests/runtime/rank_procs.py) -------------------------
def _parent_store() -> dist.TCPStore:
    """A client of the store the test process hosts (the one it polls for "ready")."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def _guard(rank: int, world: int, timeout: float, interval: float, out: str, describe=None) -> FailureGuard:
    return FailureGuard(default_store(), rank=rank, world_size=world, timeout=timeout, interval=interval,
                        describe=describe, on_exit=[lambda: (Path(out) / f"exit-{rank}").touch()])


def toy_pipeline(rank: int, world: int, timeout: float, interval: float, out: str) -> None:
    from hybridpipe.comm.p2p import open_channels

    with _guard(rank, world, timeout, interval, out, describe_ranks(toy_plan())):
        ch = open_channels([(0, 2), (1, 2), (2, 3)], mode="sa", timeout=timeout * 10)
        dp = dist.new_group([0, 1])
        it = 0
        while True:
            if rank in (0, 1):
                ch.send(2, f"act/{it}", {"x": torch.full((256,), float(rank))})
                g = ch.recv(2, f"grad/{it}")["x"]
                dist.all_reduce(g, group=dp)
            elif rank == 2:
                a, b = ch.recv(0, f"act/{it}")["x"], ch.recv(1, f"act/{it}")["x"]
                ch.send(3, f"act/{it}", {"x": a + b})
                g = ch.recv(3, f"grad/{it}")["x"]
                ch.send(0, f"grad/{it}", {"x": g})
                ch.send(1, f"grad/{it}", {"x": g})
            else:
                ch.send(2, f"grad/{it}", {"x": ch.recv(2, f"act/{it}")["x"] * 2})
            it += 1
            if it == 20:
                _parent_store().add("ready", 1)


def all_reduce_loop(rank: int, world: int, timeout: float, interval: float, out: str) -> None:
    with _guard(rank, world, timeout, interval, out):
        x = torch.ones(1000)
        for it in range(10**9):
            dist.all_reduce(x)
            x.fill_(1.0)
            if it == 20:
                _parent_store().add("ready", 1)


def raise_on_rank(rank: int, world: int, timeout: float, interval: float, out: str) -> None:
    with _guard(rank, world, timeout, interval, out):
        x = torch.ones(10)
        for it in range(10**9):
            if rank == 2 and it == 5:
                raise ValueError("stage 2 got a bad batch")
            dist.all_reduce(x)


def test_the_exit_line_reaches_stderr_in_one_write(monkeypatch):
    """Every rank of a host says its line into one log at once: a line written in two pieces (print's
    text, then its newline) ran two ranks' lines together in test_preempt's log."""
    writes: list[str] = []

    class Stderr:
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    guard = FailureGuard(dist.HashStore(), rank=1, world_size=2, timeout=5.0)
    monkeypatch.setattr(sys, "stderr", Stderr())
    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(Exited):
        guard.handle(UserError("the plan has no stage 3"))
    lines = [w for w in writes if "the plan has no stage 3" in w]
    assert lines == ["hybridpipe rank 1: failed: UserError: the plan has no stage 3\n"], writes
