"""A CPU ``sa`` link's caller that comes back faster than frames arrive receives itself (link_sa.py):
its receive thread parks. What that must keep, on two real gloo processes: every frame in order and
with its tensors, a wrong key leaving the frame queued, unbounded buffering once the caller is away
(the thread takes the receive back: a sender never waits for the receiver's program for long), and,
when the peer is lost, the frames it sent before, then a clear, sticky error."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import P2PError, PeerLost, ProtocolError, link_sa, open_channels
from tests.comm.p2p.procs import expect_ok, run_ranks
from tests.comm.p2p.scenarios import payload, same

AWAY_S = 0.8        # the receiver's absence while the sender pushes (>> 2 x link_sa.PARK_S)


def _msg(i: int) -> dict[str, torch.Tensor]:
    return {"x": payload(i, (3, 5), torch.float32), "y": payload(100 + i, (7,), torch.float64)}


def _parked(link, within: float = 5.0) -> bool:
    """The receive thread left the posted receive to the caller (it holds ``own`` while receiving)."""
    end = time.monotonic() + within
    while link.own.locked() and time.monotonic() < end:
        time.sleep(0.001)
    return not link.own.locked()


def _direct(rank: int, world: int) -> dict:
    ch = open_channels([(0, 1)], "sa", timeout=30)
    out: dict = {}
    if rank == 0:
        time.sleep(0.3)                 # rank 1 is waiting for the first frame
        for i in range(8):
            ch.send(1, f"m/{i}", _msg(i))
        ch.flush()
        dist.barrier()                  # rank 1 is away from now on
        t = time.monotonic()
        for i in range(8, 20):
            ch.send(1, f"m/{i}", _msg(i))
        ch.flush()
        out["flush_s"] = time.monotonic() - t
    else:
        link = ch._links[0]
        via_inbox = []
        deliver = link._received

        def counted(box, f, item):
            via_inbox.append(f.key)
            return deliver(box, f, item)
        link._received = counted
        got = [same(ch.recv(0, "m/0"), _msg(0))]
        out["parked"] = _parked(link)
        got += [same(ch.recv(0, f"m/{i}"), _msg(i)) for i in range(1, 4)]
        try:
            ch.recv(0, "m/5")
            out["mismatch"] = None
        except ProtocolError as e:
            out["mismatch"] = str(e)
        got += [same(ch.recv(0, f"m/{i}"), _msg(i)) for i in range(4, 8)]
        out["via_inbox_while_taking"] = list(via_inbox)
        dist.barrier()
        time.sleep(AWAY_S)
        got += [same(ch.recv(0, f"m/{i}"), _msg(i)) for i in range(8, 20)]
        out["via_inbox_away"] = [k for k in via_inbox if k not in out["via_inbox_while_taking"] and k != "close"]
        out["got"] = got
    ch.close()
    return out


def test_a_caller_receives_itself_and_the_thread_takes_over_when_it_is_away():
    values = expect_ok(run_ranks(_direct, 2, timeout=60))
    sender, receiver = values[0], values[1]
    assert all(receiver["got"]) and len(receiver["got"]) == 20, receiver
    # through the inbox: the first frame (the thread handed it to the waiting caller, then parked) and
    # m/4, which the caller received itself when it asked for m/5: it stayed queued for the next recv
    assert receiver["parked"], receiver
    assert receiver["via_inbox_while_taking"] == ["m/0", "m/4"], receiver
    assert receiver["mismatch"] and "'m/4'" in receiver["mismatch"], receiver
    # away: the thread took the receive back and received every frame, so the sender's flush did
    # not wait for the receiver to come back
    assert receiver["via_inbox_away"] == [f"m/{i}" for i in range(8, 20)], receiver
    assert sender["flush_s"] < AWAY_S * 0.7, sender


def _lost(rank: int, world: int, how: str) -> dict:
    link_sa.PARK_S = 30.0           # the thread stays parked: the caller's own wait meets the failure
    ch = open_channels([(0, 1)], "sa", timeout=3)
    if rank == 0:
        time.sleep(0.3)
        ch.send(1, "m/0", _msg(0))
        ch.flush()
        ch.send(1, "m/1", _msg(1))
        ch.flush()                      # m/1 is in rank 1's posted receive
        time.sleep(0.3)                 # ... and rank 1 is waiting for m/2
        if how == "kill":
            os._exit(17)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    link = ch._links[0]
    out: dict = {"m0": same(ch.recv(0, "m/0"), _msg(0)), "parked": _parked(link)}
    time.sleep(0.6)                     # rank 0 is gone (kill) or frozen (stop) by now
    out["m1"] = same(ch.recv(0, "m/1"), _msg(1))       # sent before: still delivered
    for name in ("m2", "again"):
        t = time.monotonic()
        try:
            ch.recv(0, "m/2")
            out[name] = {"error": None}
        except P2PError as e:
            out[name] = {"error": type(e).__name__, "peer": e.peer, "text": str(e), "s": time.monotonic() - t}
    t = time.monotonic()
    ch.close()
    out["close_s"] = time.monotonic() - t
    return out


def _check_lost(how: str) -> dict:
    outcomes = run_ranks(_lost, 2, args=(how,), timeout=60, wait_for={1})
    assert outcomes[1].status == "ok", outcomes
    r = outcomes[1].value
    assert r["m0"] and r["parked"] and r["m1"], r
    first, again = r["m2"], r["again"]
    assert first["peer"] == 0 and "recv 'm/2'" in first["text"], r
    # sticky: the same failure at once, without a second wait
    assert again["error"] == first["error"] and again["s"] < 0.5, r
    assert r["close_s"] < 5.0, r
    return r


def test_a_peer_killed_while_the_caller_waits_itself_is_lost_after_its_last_frame():
    r = _check_lost("kill")
    assert r["m2"]["error"] == PeerLost.__name__ and r["m2"]["s"] < 2.0, r


@pytest.mark.slow
def test_a_frozen_peer_times_out_the_callers_own_wait_and_the_link_stays_failed():
    r = _check_lost("stop")
    # gloo closes the connection when the wait times out: P2PTimeout after the channel's timeout
    assert r["m2"]["error"] == "P2PTimeout" and 2.5 < r["m2"]["s"] < 10.0, r
