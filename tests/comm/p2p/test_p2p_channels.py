"""Channels between real processes (gloo on 127.0.0.1), every mode, bounded by timeouts."""

from __future__ import annotations

import os

import pytest

from hybridpipe.comm.p2p import MODES
from tests.comm.p2p import failure_scenarios, scenarios
from tests.comm.p2p.procs import expect_ok, run_ranks

FAIL_TIMEOUT = 3.0      # the channels' timeout in the failure scenarios
IDLE_TIMEOUT = 15.0     # their idle timeout where a peer is killed (the background threads' bound)
OPEN_TIMEOUT = 20.0     # generous where nothing should time out (the machine is shared and slow)


def slack() -> float:
    """Seconds a rank may take past FAIL_TIMEOUT to raise: 2 s on an idle machine, more in proportion
    when more processes than cores are running (a 2-core machine at load 13 took 5.5 s to notice a
    3 s timeout: the ranks waited for a core, not for a second timeout)."""
    return 2.0 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def test_round_trips_every_mode_many_in_flight_and_shape_changes():
    values = expect_ok(run_ranks(scenarios.roundtrip, 2, args=(MODES, 16, WAITS), timeout=120))
    for rank, report in values.items():
        _check_send_waits(rank, report.pop("send_waits"))
        for mode in MODES:
            r = report[mode]
            assert r["problems"] == [], (rank, mode)
            # metadata travels once per key kind (and lane), again exactly when it changes
            assert r["meta_sent"] == r["meta_expected"], (rank, mode, r)
            # on_transfer saw every byte of both directions, with ordered timestamps
            assert r["transfer_bytes"] == r["expected_bytes"] > 0, (rank, mode, r)
            assert r["peers"] == [1 - rank] and r["times_ok"]
            assert r["threads_left"] == 0             # close() stopped every thread
            # a frame of an announced shape is one message: one send (not a header and a payload)
            if rank == 0:
                assert r["steady_frames"] == 8 * (3 if mode == "per-tensor" else 1), (mode, r)
                assert r["steady_sends"] == r["steady_frames"], (mode, r)


WAITS = 6


def _check_send_waits(rank: int, report: dict) -> None:
    """``sa`` on the CPU without a timeline (no ``on_transfer``): no send thread, so no wake-up per
    frame; the caller waits for each frame itself (WAITS frames + the close). With the hook, a send
    thread waits and reports each one."""
    plain, hooked = report["plain"], report["hooked"]
    assert plain["problems"] == [] and hooked["problems"] == [], (rank, report)
    assert plain["threads"] == ["recv"] and hooked["threads"] == ["recv", "send"], (rank, report)
    assert plain["waited_by_caller"] == WAITS + 1 and plain["waited_elsewhere"] == 0, (rank, plain)
    assert hooked["waited_by_caller"] == 0 and hooked["waited_elsewhere"] == WAITS + 1, (rank, hooked)
    assert hooked["sent_transfers"] == WAITS and plain["threads_left"] == hooked["threads_left"] == 0


def test_fan_in_from_three_replicas_and_skip_edges_every_mode():
    values = expect_ok(run_ranks(scenarios.fanin_and_skips, 4, args=(MODES,), timeout=120))
    for rank, report in values.items():
        for mode in MODES:
            assert report[mode]["problems"] == [], (rank, mode)
            assert report[mode]["threads_left"] == 0
    # rank 3 talked to all three replicas, in every mode
    assert all(set(values[3][m]["stats"]) == {0, 1, 2} for m in MODES)


@pytest.mark.parametrize("seeds", [(1,), pytest.param((2, 3, 4, 5, 6), marks=pytest.mark.slow)])
def test_random_traffic_between_all_pairs_every_mode(seeds):
    values = expect_ok(run_ranks(scenarios.random_graphs, 4, args=(MODES, seeds), timeout=300))
    assert all(problems == [] for report in values.values() for problems in report.values())
    assert len(values[0]) == len(seeds) * len(MODES)


def _check_failure(out, how: str, mode: str) -> None:
    for rank in (1, 2):
        assert out[rank].status == "ok", out
    r1, r2 = out[1].value, out[2].value
    assert r1["hello"] and r2["hello"]
    for r, what in ((r1["wait"], "recv 'act/0'"), (r2["wait"], None)):
        # the error names the culprit and what was awaited ...
        assert r["error"] in (("PeerLost", "P2PTimeout") if how == "kill" else ("P2PTimeout",)), r
        assert r["peer"] == 0 and "rank 0" in r["text"]
        if what:
            assert r["what"] == what
        # ... within the timeout (a dead process is noticed from its closed connection)
        assert r["elapsed"] < FAIL_TIMEOUT + slack(), r
        if how == "stop":
            assert r["elapsed"] >= FAIL_TIMEOUT - 0.05, r
    # the two survivors' own link is unaffected; a wrong key is a ProtocolError naming the peer
    assert r1["after"] and r2["after"]
    assert r1["loops"] == r2["loops"] == 1, (r1, r2)     # their p2p groups on the default group's device
    assert r1["mismatch"]["error"] == "ProtocolError" and r1["mismatch"]["peer"] == 2
    assert "'ok/0'" in r1["mismatch"]["text"] and "'act/1'" in r1["mismatch"]["text"]
    # close() returns within the timeout even with a frozen peer; a dead one leaves no thread ...
    for r in (r1, r2):
        assert r["close_elapsed"] < FAIL_TIMEOUT + slack(), r
        if how == "kill" and r["threads_left"]:
            # ... but one: gloo never wakes the wait on a send that was half written when its peer died
            # (links.py; neither the peer's death nor Backend.abort/shutdown does), and sra's thread waits
            # for its sends up to the idle timeout: it is rank 2's, in a send to rank 0, and the idle
            # timeout ends it
            assert mode == "sra" and r is r2 and r2["wait"]["error"] == "P2PTimeout", r
            (name, left), = r["left"].items()
            assert name == "p2p-sra-2-0-sendrecv" and "links.py:_send > frames.py:complete" in left["in"], r
            assert left["ended_s"] is not None and left["ended_s"] < IDLE_TIMEOUT + slack(), r


def _run_failure(mode: str, how: str) -> None:
    idle = IDLE_TIMEOUT if how == "kill" else None
    out = run_ranks(failure_scenarios.peer_failure, 3, args=(mode, how, FAIL_TIMEOUT, idle), timeout=90,
                    wait_for={1, 2})
    _check_failure(out, how, mode)
    if how == "kill":
        assert out[0].status == "exit" and out[0].exitcode == 17


@pytest.mark.parametrize("mode", ["sa"])
def test_killed_peer_is_reported_by_name(mode):
    _run_failure(mode, "kill")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("mode", MODES)
def test_peer_failures_every_mode(mode, how):
    """A frozen peer ("stop": only timeouts tell) runs here only: with 3 s timeouts and 16 MB sends
    its survivors' own exchange timed out at load 19 on 2 cores (tests/SUITE.md)."""
    _run_failure(mode, how)


def test_mismatched_modes_or_orders_fail_at_open():
    values = expect_ok(run_ranks(failure_scenarios.mismatched_open, 2, args=(FAIL_TIMEOUT,), timeout=60))
    for rank, report in values.items():
        for case in ("mode", "order"):
            r = report[case]
            assert r["error"] == "ProtocolError" and r["peer"] == 1 - rank, (rank, case, r)
            assert r["elapsed"] < OPEN_TIMEOUT


def _close_beside_frozen_peer(rank: int, world: int, timeout: float) -> dict:
    """Rank 0 opens its channel to rank 2 and freezes; rank 2 posts a frame to it that cannot leave
    (more than the sockets hold), then closes; rank 1, linked to rank 2 only, closes at once and
    waits for rank 2's CLOSE."""
    import signal
    import time

    import torch

    from hybridpipe.comm.p2p import open_channels

    ch = open_channels([(0, 2), (1, 2)], "sa", timeout=timeout)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    if rank == 2:
        time.sleep(0.3)
        ch.send(0, "big/0", {"x": torch.ones(4 << 20)})
    t = time.monotonic()
    ch.close()
    return {"close_elapsed": time.monotonic() - t}


@pytest.mark.slow
def test_a_frozen_peers_unsent_frame_does_not_delay_the_others_close():
    """close() posts every link's CLOSE before it waits for any link's frames: rank 2's frame to the
    frozen rank 0 (waited up to the timeout) must not hold back the CLOSE rank 1 is waiting for
    (it did: rank 1's close took the whole timeout and left its receive thread behind)."""
    out = run_ranks(_close_beside_frozen_peer, 3, args=(FAIL_TIMEOUT,), timeout=60, wait_for={1, 2})
    assert out[1].status == "ok" and out[2].status == "ok", out
    assert out[1].value["close_elapsed"] < FAIL_TIMEOUT - 1.0, out[1].value     # rank 2's CLOSE came at once
    assert out[2].value["close_elapsed"] < FAIL_TIMEOUT + slack(), out[2].value
