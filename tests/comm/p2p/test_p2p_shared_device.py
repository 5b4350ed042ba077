"""A process's p2p groups share one gloo device, the default group's: one gloo event-loop
thread a rank (torch's pipelining has one too), however many edges, directions and lanes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import link_orders, open_channels
from hybridpipe.comm.p2p.shared_gloo import BACKEND
from tests.comm.p2p import scenarios
from tests.comm.p2p.procs import expect_ok, run_ranks

CHAIN = [(0, 1), (1, 2)]
PEERS = {0: [1], 1: [0, 2], 2: [1]}
SHAPES = {"a": ((5, 7), torch.float32), "b": ((9,), torch.int64)}


def _msg(src: int, dst: int) -> dict[str, torch.Tensor]:
    return scenarios.message(10 * src + dst, SHAPES)


def _chain(rank: int, world: int) -> dict:
    """Every mode's channels on a 3-rank chain (the middle rank has 2 edges; per-tensor 2 lanes):
    a message each way on every link, checked bitwise, and the gloo loop threads counted."""
    prog = {r: [("send", p, f"m/{r}") for p in PEERS[r]] + [("recv", p, f"m/{p}") for p in PEERS[r]]
            for r in PEERS}
    out: dict = {"loops_before": scenarios.gloo_loop_threads()}
    for mode in ("sa", "sra", "per-tensor"):
        order = link_orders(prog)[rank] if mode == "sra" else None
        ch = open_channels(CHAIN, mode, timeout=30, order=order, max_tensors=2)
        for p in PEERS[rank]:
            ch.send(p, f"m/{rank}", _msg(rank, p))
        ok = [scenarios.same(ch.recv(p, f"m/{p}"), _msg(p, rank)) for p in PEERS[rank]]
        ch.flush()
        out[mode] = {"ok": ok, "loops": scenarios.gloo_loop_threads(),
                     "backend": str(dist.get_backend(ch.groups.outbound(PEERS[rank][0]).control))}
        ch.close()
    return out


@pytest.mark.slow     # ~4 s; the default suite's guard is the killed-peer test's loop-thread count
def test_one_gloo_loop_thread_a_rank_and_traffic_intact():
    values = expect_ok(run_ranks(_chain, 3, timeout=90))
    for rank, r in values.items():
        assert r["loops_before"] == 1, (rank, r)      # the default group's device
        for mode in ("sa", "sra", "per-tensor"):
            assert r[mode]["ok"] == [True] * len(PEERS[rank]), (rank, mode, r)
            # plain gloo groups would add a loop thread per direction and lane of each edge
            # (rank 1, per-tensor's 2 lanes: 1 + 2 edges x 2 directions x 2 lanes = 9)
            assert r[mode]["loops"] == 1, (rank, mode, r)
            assert r[mode]["backend"] == BACKEND, (rank, mode, r)
