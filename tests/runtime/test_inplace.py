"""In-place recovery of a lost replica: the decisions (runtime/inplace.py) and cutting a process's
connections (runtime/connections.py), without rank processes. The job-level tests are in
test_inplace_job.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hybridpipe.runtime.connections import cut_connections, tcp_connections
from hybridpipe.runtime.inplace import IN_PLACE, RESTART, STEP, Decision, decide, shrink_plan
from tests.pipeline.harness import make_plan


@pytest.fixture(scope="module")
def plan():
    """Stage 0 on ranks 0, 1, 2; stage 1 on rank 3 (12 micro-batches: any replica count divides them)."""
    return make_plan("mlp", [3], [3, 1], micro_batches=12, batch_size=2)


def test_the_survivors_plan_keeps_every_stage_and_renumbers_the_ranks_in_order(plan):
    shrunk = shrink_plan(plan, [0, 2, 3])
    assert [s.ranks for s in shrunk.stages] == [(0, 1), (2,)]
    assert [s.replicas for s in shrunk.stages] == [2, 1]
    assert [(s.first_node, s.last_node) for s in shrunk.stages] == [(s.first_node, s.last_node) for s in plan.stages]
    assert shrunk.world_size == 3 and shrunk.micro_batches == plan.micro_batches
    assert shrink_plan(plan, [1, 3]).stages[0].ranks == (0,)


def test_a_stage_without_a_replica_left_cannot_go_on(plan):
    with pytest.raises(ValueError, match="stage 1 lost every replica"):
        shrink_plan(plan, [0, 1, 2])


def reports(ranks, steps=5, phase=STEP):
    return {r: {"steps": steps, "phase": phase} for r in ranks}


def test_a_lost_replica_is_taken_over_in_place_from_the_step_every_survivor_completed(plan):
    d = decide(plan, 4, reports([0, 2, 3]), {1}, flushing=True)
    assert d == Decision(IN_PLACE, (0, 2, 3), (1,), 5)
    assert [d.new_rank(r) for r in range(4)] == [0, None, 1, 2]
    assert Decision.from_json(d.to_json()) == d


@pytest.mark.parametrize(("survivors", "lost", "extra", "why"), [
    ([0, 1, 2], {3}, {}, "stage 1 lost every replica"),
    ([0, 2, 3], {1}, {"unreported": {2}}, "rank 2 is alive but did not leave its step in time"),
    ([0, 2, 3], {1}, {"flushing": False}, "has no step that every rank completes together"),
    ([0, 2, 3], set(), {}, "no rank was lost"),
])
def test_what_cannot_go_on_in_place_restarts(plan, survivors, lost, extra, why):
    kwargs = {"flushing": True, **extra}
    d = decide(plan, 4, reports(survivors), lost, **kwargs)
    assert d.kind == RESTART and why in d.reason, d


def test_survivors_that_disagree_on_the_step_or_were_outside_one_restart(plan):
    mixed = {**reports([0, 2]), 3: {"steps": 6, "phase": STEP}}
    d = decide(plan, 4, mixed, {1}, flushing=True)
    assert d.kind == RESTART and "different numbers of steps (5 and 6)" in d.reason
    stats = {**reports([0, 2]), 3: {"steps": 5, "phase": STEP, "stats": True}}
    d = decide(plan, 4, stats, {1}, flushing=True)
    assert d.kind == RESTART and "rank 3's stage combines running statistics" in d.reason
    saving = {**reports([0, 2]), 3: {"steps": 5, "phase": "outside a step"}}
    d = decide(plan, 4, saving, {1}, flushing=True)
    assert d.kind == RESTART and "rank 3 was outside a training step" in d.reason


def test_a_stage_without_a_replica_is_the_reason_wherever_the_kill_landed(plan):
    """Survivors a step apart (the kill landed in the step's final all-reduce) and a stage left with no
    replica: the stage is the reason, the one that holds wherever the kill lands
    (test_inplace_job.py::test_a_stage_left_without_a_replica_restarts failed on it, seen once in 13)."""
    apart = {**reports([0, 1]), 2: {"steps": 6, "phase": STEP}}
    d = decide(plan, 4, apart, {3}, flushing=True)
    assert d.kind == RESTART and "stage 1 lost every replica" in d.reason, d


def test_cutting_the_connections_wakes_a_blocked_receive_and_keeps_the_stores():
    server = socket.create_server(("127.0.0.1", 0))
    kept_server = socket.create_server(("127.0.0.1", 0))
    port, kept = server.getsockname()[1], kept_server.getsockname()[1]
    client, kept_client = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", kept))
    peer, _ = server.accept()
    kept_peer, _ = kept_server.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(1)), daemon=True)
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()                    # blocked: nothing was sent
    assert client.fileno() in tcp_connections()
    t0 = time.monotonic()
    assert cut_connections(keep_port=kept) >= 2     # both ends of the first pair (this process holds both)
    reader.join(5)
    assert not reader.is_alive() and got == [b""] and time.monotonic() - t0 < 2
    kept_client.sendall(b"x")
    assert kept_peer.recv(1) == b"x"            # the store's connection still works
    for s in (server, kept_server, client, kept_client, peer, kept_peer):
        s.close()
