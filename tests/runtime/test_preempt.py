"""SIGTERM / SIGINT stop a job (runtime/stop_signals.py, failure.py): the signal is seen at once
from a thread, the cause is named (a stop of the job, a killed rank, a rank signalled alone), every
rank exits with the signal's code, and a checkpoint in progress is finished or discarded whole."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint_files import complete_steps, step_dirs
from hybridpipe.runtime.failure import EXIT_PEER_LOST
from hybridpipe.runtime.failure_facts import Failure, read_first, report_first
from hybridpipe.runtime.stop_signals import SignalWatch, alone_line, stop_cause, stop_line
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import ROOT, _env, launch

STOP = "stopped by SIGTERM to the agent: no rank failed (every rank on"


# ---- the parts, in this process ------------------------------------------------------------------
def test_a_signal_is_seen_by_a_thread_while_the_main_thread_is_blocked_and_not_interrupted():
    got: list[tuple[int, str]] = []
    seen = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    watch = SignalWatch(lambda s: (got.append((s, threading.current_thread().name)), seen.set()))
    assert watch.start()
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        assert seen.wait(10)                            # the main thread sat in a blocking wait: never interrupted
        print(f"seen {1000 * (time.monotonic() - t0 - 0.1):.1f} ms after the signal")
    finally:
        watch.stop()
    assert got == [(signal.SIGTERM, "stop-signals")]
    assert signal.getsignal(signal.SIGTERM) == before


def _store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def test_the_cause_of_a_stop_is_the_published_failure_then_a_killed_peer_then_the_job_then_this_rank():
    failed = Failure(3, "RuntimeError: boom", 3)
    store = dist.PrefixStore("a", _store())
    report_first(store, failed)
    assert stop_cause(store, 0, signal.SIGTERM, lambda: None, lambda: [1], 0.0) == failed

    killed = Failure(2, "its process 7 is gone (killed or crashed without a word)", 0)
    store = dist.PrefixStore("b", _store())
    assert stop_cause(store, 0, signal.SIGTERM, lambda: killed, lambda: [1], 0.0) == killed == read_first(store)

    store = dist.PrefixStore("c", _store())
    store.set("sig/1", "{}")                            # every other rank of this host got it too
    first = stop_cause(store, 0, signal.SIGTERM, lambda: None, lambda: [1], 5.0)
    assert first == Failure(0, stop_line("SIGTERM"), 0, stop="SIGTERM") == read_first(store)

    store = dist.PrefixStore("d", _store())             # rank 1 never got one: this rank alone
    t0 = time.monotonic()
    first = stop_cause(store, 0, signal.SIGINT, lambda: None, lambda: [1], 0.3)
    assert first == Failure(0, alone_line("SIGINT"), 0) and time.monotonic() - t0 >= 0.3


# ---- a job stopped by SIGTERM to torchrun's agent ---------------------------------------------------
def test_sigterm_to_the_agent_stops_every_rank_naming_it_and_leaves_only_whole_checkpoints(tmp_path):
    save_plan(make_plan("mlp", [3], [2, 1], micro_batches=4, batch_size=4), tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(ROOT / "launch.py"), "--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--checkpoint-dir",
           str(ckpt), "--checkpoint-every", "1", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    with open(tmp_path / "torchrun.log", "w+") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while len(step_dirs(ckpt)) < 3:             # saving every step: one is likely under way at the signal
                assert time.monotonic() < deadline and agent.poll() is None, log.seek(0) or log.read()
                time.sleep(0.01)
            t0 = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            agent.wait(60)
            took = time.monotonic() - t0
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        log.seek(0)
        text = log.read()
    lines = [x for x in text.splitlines() if x.startswith("hybridpipe rank")]
    assert sorted(x.split(":")[0] for x in lines) == ["hybridpipe rank 0 (stage 0 replica 0)",
                                                      "hybridpipe rank 1 (stage 0 replica 1)",
                                                      "hybridpipe rank 2 (stage 1 replica 0)"], text
    assert all(STOP in x for x in lines) and "failed first" not in text, text
    assert complete_steps(ckpt, verify=True) == sorted(step_dirs(ckpt)), text      # finished or discarded whole
    print(f"every rank stopped {took:.2f} s after SIGTERM to the agent")


# ---- exit codes, and a rank signalled alone (slow) ------------------------------------------------
def _signal_ranks(tmp_path, ranks: list[int], sig: int):
    def on_start(procs):
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics" / "rank-00002.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        for r in ranks:                     # as torchrun's agent does: one after the other, at once
            procs[r].send_signal(sig)

    save_plan(make_plan("mlp", [3], [2, 1], micro_batches=4, batch_size=4), tmp_path / "plan.json")
    return launch(["--plan", str(tmp_path / "plan.json"), "--steps", "100000", "--run-dir", str(tmp_path / "run"),
                   "--no-progress", "--timeout", "60"], 3, timeout=120, on_start=on_start)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_every_rank_stopped_by_a_signal_exits_with_its_code(tmp_path, sig):
    ranks = _signal_ranks(tmp_path, [0, 1, 2], sig)
    name = signal.Signals(sig).name
    assert [r.returncode for r in ranks] == [128 + sig] * 3, ranks
    assert all(f"stopped by {name}: no rank failed" in r.stderr for r in ranks), ranks


@pytest.mark.slow
def test_a_rank_sent_sigterm_alone_is_named_by_the_others(tmp_path):
    ranks = _signal_ranks(tmp_path, [1], signal.SIGTERM)
    assert ranks[1].returncode == 143 and "stopped by SIGTERM sent to its process alone" in ranks[1].stderr, ranks
    for r in (ranks[0], ranks[2]):
        assert r.returncode == EXIT_PEER_LOST, ranks
        assert "rank 1 (stage 0 replica 1) failed first: stopped by SIGTERM sent to its process alone" in r.stderr
