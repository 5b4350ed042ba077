"""A sender reuses a whole frame's buffer for a later frame of the same length, but never while
the send of the frame it holds is still in flight (gloo sends from the buffer's memory)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import pair_groups
from hybridpipe.comm.p2p.device import SideStream
from hybridpipe.comm.p2p.frames import FrameReceiver, FrameSender
from tests.comm.p2p.procs import expect_ok, run_ranks

SHAPE = (4, 16)


def _frame(tag: int) -> list[tuple[str, torch.Tensor]]:
    return [("x", torch.full(SHAPE, float(tag))), ("y", torch.arange(8, dtype=torch.int64) + tag)]


def _back_to_back(rank: int, world: int) -> dict:
    """Rank 0 posts frames 1 and 2 back to back while rank 1 has no receive posted (gloo holds a
    send until the peer posts its receive: frame 1 is surely in flight when frame 2 is packed);
    then frame 3 after both completed. Rank 1 reports what arrived."""
    groups = pair_groups([(0, 1)])
    peer = 1 - rank
    deadline = time.monotonic() + 30
    if rank == 0:
        end = FrameSender(groups.outbound(peer), peer, SideStream(groups.device), time.perf_counter)
        end.complete(end.post("t/0", 0, 2, _frame(0)), deadline)    # metadata announced: later frames alike
        dist.barrier()
        first = end.post("t/1", 1, 2, _frame(1))
        second = end.post("t/2", 2, 2, _frame(2))
        bufs = [first.tensors[0].data_ptr(), second.tensors[0].data_ptr()]
        dist.barrier()                  # now rank 1 receives
        end.complete(first, deadline)
        end.complete(second, deadline)
        third = end.post("t/3", 3, 2, _frame(3))
        reused = third.tensors[0].data_ptr() in bufs
        end.complete(third, deadline)
        dist.barrier()
        return {"distinct_in_flight": bufs[0] != bufs[1], "reused_after_completion": reused}
    end = FrameReceiver(groups.inbound(peer), peer, SideStream(groups.device), time.perf_counter, prepost=False)
    end.receive(deadline)
    dist.barrier()
    time.sleep(0.2)                     # rank 0 packs both frames while nothing is posted here
    dist.barrier()
    got = [end.receive(deadline) for _ in range(3)]
    dist.barrier()
    return {"same": [f.key == f"t/{i + 1}" and all(torch.equal(f.tensors[n], t) for n, t in _frame(i + 1))
                     for i, f in enumerate(got)]}


def test_a_frames_buffer_is_not_reused_while_its_send_is_in_flight():
    values = expect_ok(run_ranks(_back_to_back, 2, timeout=60))
    assert values[1]["same"] == [True, True, True], values
    assert values[0] == {"distinct_in_flight": True, "reused_after_completion": True}, values
