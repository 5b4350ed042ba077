"""What each rank does in the multi-process tests of a peer's failure (run through procs.run_ranks):
a peer killed, hung or closing mid-message, and channels opened with mismatched settings. Plain data
out, as in scenarios.py, whose payloads and thread counts these use."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import Channels, P2PError, link_orders, open_channels, pair_groups
from tests.comm.p2p.scenarios import gloo_loop_threads, p2p_threads, payload, same

TRIANGLE = [(0, 1), (0, 2), (1, 2)]


def _failure_orders(n_big: int) -> dict[int, dict[int, list]]:
    """The sra orders of the failure scenarios (what the ranks would do if rank 0 went on)."""
    prog = {0: [("send", 1, "hi/0"), ("send", 2, "hi/0"), ("send", 1, "act/0")]
            + [("recv", 2, f"big/{i}") for i in range(n_big)],
            1: [("recv", 0, "hi/0"), ("recv", 0, "act/0"), ("recv", 2, "act/1"), ("send", 2, "ok/0")],
            2: [("recv", 0, "hi/0")] + [("send", 0, f"big/{i}") for i in range(n_big)]
            + [("send", 1, "act/1"), ("recv", 1, "ok/0")]}
    return link_orders(prog)


def _attempt(fn) -> dict:
    t = time.monotonic()
    try:
        fn()
        return {"error": None, "elapsed": time.monotonic() - t}
    except P2PError as e:
        return {"error": type(e).__name__, "peer": e.peer, "what": e.what, "text": str(e),
                "elapsed": time.monotonic() - t}


def peer_failure(rank: int, world: int, mode: str, how: str, timeout: float, idle: float | None = None) -> dict:
    """Rank 0 opens its channels, says hello, then dies (``how="kill"``) or freezes (``"stop"``).
    Rank 1 waits for a message from it; rank 2 pushes large messages to it and flushes. Then
    1 and 2 check that their own link is unaffected and that a wrong key is a ProtocolError.
    ``idle``: the channels' idle timeout; with it, p2p threads still running after close are
    watched until they end (up to ``idle`` and twice the slack): which, blocked where, for how long."""
    n_big, big = 8, (4 << 20,)               # 8 x 16 MB: more than any socket buffer holds
    order = _failure_orders(n_big)[rank] if mode == "sra" else None
    ch = open_channels(TRIANGLE, mode, timeout=timeout, order=order, idle_timeout=idle)
    hello = {"x": payload(1, (3,), torch.float32)}
    if rank == 0:
        ch.send(1, "hi/0", hello)
        ch.send(2, "hi/0", hello)
        ch.flush()
        time.sleep(0.3)
        if how == "kill":
            os._exit(17)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    out: dict = {"hello": same(ch.recv(0, "hi/0"), hello), "loops": gloo_loop_threads()}
    # rank 2 sends act/1 only once its flush to rank 0 has failed (up to the whole timeout); rank 1's
    # receive of it (one timeout too) starts when it has heard so through the job's store, not when its
    # own wait on rank 0 ended: a killed rank 0 ends that wait at once, and then the two timeouts raced
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        out["wait"] = _attempt(lambda: ch.recv(0, "act/0"))
        out["mismatch"] = _attempt(lambda: ch.recv(2, "ok/0"))
        store.wait(["peer_failure/pushed"], datetime.timedelta(seconds=60))
        out["after"] = same(ch.recv(2, "act/1"), hello)
        ch.send(2, "ok/0", hello)
    else:
        def push() -> None:
            for i in range(n_big):
                ch.send(0, f"big/{i}", {"x": payload(i, big, torch.float32)})
            ch.flush()
        out["wait"] = _attempt(push)
        store.set("peer_failure/pushed", "1")
        ch.send(1, "act/1", hello)
        out["after"] = same(ch.recv(1, "ok/0"), hello)
    ch.flush(3 - rank)
    t = time.monotonic()
    ch.close()                                       # never hangs, never raises
    out["close_elapsed"] = time.monotonic() - t
    out["threads_left"] = p2p_threads()
    if idle is not None and out["threads_left"]:
        out["left"] = _watch_left(time.monotonic() + idle + 2 * slack_s())
    return out


def slack_s() -> float:
    """2 s, more in proportion when more processes than cores are running (test_p2p_channels.slack)."""
    return 2.0 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _watch_left(deadline: float) -> dict[str, dict]:
    """Per p2p thread still running: where it waits (its hybridpipe calls, outermost first) and when it
    ended (seconds from now; None: still running at ``deadline``)."""
    t0 = time.monotonic()
    frames = sys._current_frames()
    left = {t: "" for t in threading.enumerate() if t.name.startswith("p2p-") and t.is_alive()}
    for t in left:
        stack = traceback.extract_stack(frames[t.ident]) if t.ident in frames else []
        left[t] = " > ".join(f"{Path(f.filename).name}:{f.name}" for f in stack if "hybridpipe" in f.filename)
    ended: dict[threading.Thread, float | None] = {t: None for t in left}
    while time.monotonic() < deadline and any(t.is_alive() for t in left):
        time.sleep(0.05)
        for t in left:
            if ended[t] is None and not t.is_alive():
                ended[t] = time.monotonic() - t0
    return {t.name: {"in": where, "ended_s": ended[t]} for t, where in left.items()}


def mismatched_open(rank: int, world: int, timeout: float) -> dict:
    """Ranks 0 and 1 open channels with different modes, then with non-mirrored sra orders."""
    out = {}
    for case, cfg in (("mode", {0: ("sa", None), 1: ("per-tensor", None)}),
                      ("order", {0: ("sra", {1: [("send", "a/0"), ("recv", "b/0")]}),
                                 1: ("sra", {0: [("send", "b/0"), ("recv", "a/0")]})})):
        groups = pair_groups([(0, 1)])
        mode, order = cfg[rank]
        out[case] = _attempt(lambda: Channels(groups, mode, timeout=timeout, order=order).close())  # noqa: B023 (called now)
    dist.barrier()
    return out


# ---------------------------------------------------------------------------------------
