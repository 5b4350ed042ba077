"""The in-process transport and replica all-reduce used to run pipelines on threads."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridpipe.comm.p2p.errors import P2PTimeout, PeerLost, ProtocolError
from hybridpipe.pipeline.inprocess import InProcessGradSync, InProcessNetwork, ReplicaGroup, run_ranks


def test_messages_are_fifo_per_peer_and_owned_by_the_receiver():
    net = InProcessNetwork(timeout=5)
    a, b = net.transport(0), net.transport(1)
    t = torch.arange(4.0)
    a.send(1, "act/0", {"x": t})
    a.send(1, "act/1", {"x": t + 1})
    t.add_(100)                                   # the sender may reuse its tensor at once
    assert torch.equal(b.recv(0, "act/0")["x"], torch.arange(4.0))
    assert torch.equal(b.recv(0, "act/1")["x"], torch.arange(4.0) + 1)
    assert net.pending() == {}


def test_wrong_key_timeout_and_dead_peer_are_reported_with_the_peer():
    net = InProcessNetwork(timeout=0.2)
    a, b = net.transport(0), net.transport(1)
    a.send(1, "act/0", {"x": torch.zeros(1)})
    with pytest.raises(ProtocolError, match="rank 0.*next message from rank 0 is 'act/0'"):
        b.recv(0, "grad/0")
    assert b.recv(0, "act/0")["x"].shape == (1,)   # the mismatched message stayed queued
    with pytest.raises(P2PTimeout, match="nothing arrived"):
        b.recv(0, "act/1")
    net.fail(0, "rank 0 failed: boom")
    with pytest.raises(PeerLost, match="boom"):
        b.recv(0, "act/1")


def test_replica_group_sums_like_a_plain_sum_on_every_member():
    n = 3
    group = ReplicaGroup(n, timeout=10)
    inputs = [[torch.randn(5), torch.randn(2, 2)] for _ in range(n)]
    expected = [sum(inp[i] for inp in inputs) for i in range(2)]
    outs = [[t.clone() for t in inp] for inp in inputs]
    for _ in range(2):                                           # reusable round after round
        outs = [[t.clone() for t in inp] for inp in inputs]
        run_ranks({i: (lambda i=i, out=outs[i]: group.all_reduce_sum(i, out)) for i in range(n)}, groups=[group])
    for out in outs:
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(got, want)
        assert all(torch.equal(x, y) for x, y in zip(out, outs[0], strict=True))   # bitwise identical replicas


def test_grad_sync_sums_grads_and_counts_missing_ones_as_zero():
    mods = [torch.nn.Linear(2, 2) for _ in range(2)]
    group = ReplicaGroup(2, timeout=10)
    syncs = [InProcessGradSync(m, group, i) for i, m in enumerate(mods)]
    mods[0].weight.grad = torch.ones(2, 2)
    mods[1].weight.grad = 2 * torch.ones(2, 2)
    mods[1].bias.grad = torch.ones(2)
    run_ranks({i: syncs[i].finish for i in range(2)}, groups=[group])
    for m in mods:
        torch.testing.assert_close(m.weight.grad, 3 * torch.ones(2, 2))
        torch.testing.assert_close(m.bias.grad, torch.ones(2))


def test_a_failing_rank_breaks_the_group_instead_of_hanging():
    group = ReplicaGroup(2, timeout=30)
    started = threading.Event()

    def bad():
        started.wait(5)
        raise ValueError("replica 1 crashed")

    def good():
        started.set()
        group.all_reduce_sum(0, [torch.zeros(1)])

    with pytest.raises(ValueError, match="crashed"):
        run_ranks({0: good, 1: bad}, groups=[group], timeout=20)
