"""A steady-state message on a CPU ``sa`` channel (the default) costs a bounded number of Python
calls and aten ops: on the caller's thread for ``send`` and for ``recv``, and per frame in the
receive thread (none: a caller that comes back faster than frames arrive receives itself,
link_sa.py). What benchmarks/p2p_calls.py counts; counts do not depend on the load, so the bounds
(the measured counts) are exact: a change that adds work to every message fails here, one that
removes some lowers them."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.comm.p2p import link_sa, open_channels
from tests.comm.p2p.procs import expect_ok, run_ranks

WARMUP, COUNTED = 16, 32
C_SEND, C_RECV = 26, 18           # C built-in calls per send and per recv (the frame received by the caller)
KEYS = [f"act/0/{m}" for m in range(8)]         # the engine's keys: repeating over micro-batches
GRAD_KEYS = [f"grad/1/{m}" for m in range(8)]


class _Calls:
    """A profile function counting Python calls and calls of C built-ins (not this file's own) while ``on``."""

    def __init__(self, on: bool = False) -> None:
        self.on = on
        self.n = 0
        self.c = 0

    def __call__(self, frame, event: str, arg) -> None:
        if self.on and frame.f_code.co_filename != __file__:
            if event == "call":
                self.n += 1
            elif event == "c_call":
                self.c += 1


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(rank: int, world: int) -> dict:
    # the receiver comes back within this, so its receive thread, once parked, stays parked (even
    # under load: a thread that took the receive back would count again; see link_sa)
    link_sa.PARK_S = 30.0
    in_thread = _Calls()
    threading.setprofile(lambda *a: in_thread(*a) if threading.current_thread().name.endswith("-recv") else None)
    try:
        ch = open_channels([(0, 1)], mode="sa", timeout=30)
    finally:
        threading.setprofile(None)          # the channels' threads keep it
    msgs = [{"x": torch.randn(2, 8).requires_grad_()} for _ in KEYS]
    grads = [{"x": torch.randn(2, 8)} for _ in KEYS]       # a backward's: no graph, no grad

    def call(i: int, keys: list[str] = KEYS, sent: list[dict] = msgs) -> None:
        if rank == 0:
            if i == 0:
                time.sleep(0.3)     # rank 1 waits for the first frame: its receive thread hands it over and parks
            ch.send(1, keys[i % 8], sent[i % 8])
        else:
            ch.recv(0, keys[i % 8])

    def settle(counting: bool) -> None:
        ch.flush()
        time.sleep(0.3)         # the receive thread back in its wait for the next frame
        in_thread.on = counting     # from a wait to a wait: per frame exactly
        dist.barrier()              # (rank 0 sends nothing before)
    for i in range(WARMUP):
        call(i)
    settle(True)
    calls = _Calls(on=True)
    for i in range(WARMUP, WARMUP + COUNTED):
        sys.setprofile(calls)
        call(i)
        sys.setprofile(None)
    settle(False)
    ops = _Ops()
    for i in range(WARMUP + COUNTED, WARMUP + 2 * COUNTED):
        with ops:
            call(i)
    settle(False)
    for i in range(WARMUP):
        call(i, GRAD_KEYS, grads)
    settle(False)
    grad_ops = _Ops()
    for i in range(WARMUP, WARMUP + COUNTED):
        with grad_ops:
            call(i, GRAD_KEYS, grads)
    settle(False)
    ch.close()
    return {"calls": calls.n / COUNTED, "thread_calls": in_thread.n / COUNTED,
            "c_calls": calls.c / COUNTED, "thread_c_calls": in_thread.c / COUNTED,
            "ops": {k: v / COUNTED for k, v in ops.ops.items()},
            "grad_ops": {k: v / COUNTED for k, v in grad_ops.ops.items()}}


def test_a_message_costs_the_counted_calls_and_ops():
    """Base (1256dd4): send 31 Python calls, receive 9, the receive thread 13 per frame; base (dfbcf8c):
    send 3 aten ops (an activation) and 30 C built-ins, the receive thread 19 C built-ins a frame;
    base (5ec02b1): receive 3 Python calls, the receive thread 8 and 13 C built-ins a frame."""
    values = expect_ok(run_ranks(_count, 2, timeout=60))
    send, recv = values[0], values[1]
    # 10 a send: Channels.send, SaLink.submit, FrameSender.post, MetaCache.sent, FrameSender._buffer,
    # FrameBuffer.pack, post_send, Posted(), SaLink._reap and FrameSender.complete (the previous
    # frame's wait); the first send after a flush has nothing to wait for
    assert send["calls"] * COUNTED == 10 * COUNTED - 2, send
    # a small tensor is packed into the frame by a plain memory copy: no aten op but the send (was a
    # detach, for an activation, and a copy_; a gradient's copy_ only: a tensor without grad)
    assert send["ops"] == {"c10d.send.default": 1}, send
    assert send["grad_ops"] == {"c10d.send.default": 1}, send
    # C built-ins: no clock read without an on_transfer hook (was 2 perf_counter), the previous
    # frame's wait with the link's fixed bound (was 2 monotonic, a max and a min), the copy (was
    # detach + copy_, now is_contiguous, is_neg, data_ptr and the memmove): 30 -> 26
    assert send["c_calls"] * COUNTED == C_SEND * COUNTED - 6, send     # the first: no wait (6 calls)
    # the receiver's thread parked once it handed the first frame to the waiting caller: per frame
    # it does nothing (was 8 Python calls and 13 C built-ins, a wake-up and a hand-over through the
    # queue: base 5ec02b1), and the caller receives itself: Channels.recv, SaLink.take, QueueBox.empty
    # (twice: before and after taking the receive's lock), SaLink._receive_direct,
    # FrameReceiver.receive, decode_header, Header(), unflatten, _post, receive_buffer, Frame()
    # (was Channels.recv, SaLink.take, QueueBox.take_if): 12 where caller and thread made 11
    assert recv["thread_calls"] == 0 and recv["thread_c_calls"] == 0, recv
    assert recv["calls"] == 12, recv
    # its C built-ins: the lock, the backend's wait and receive, the queue's emptiness, the header's
    # unpacking and the tensors' views (were 6 on the caller and 13 in the thread)
    assert recv["c_calls"] == C_RECV, recv
    # the aten ops the thread ran, now on the caller: the next receive's buffer and its posting, the
    # views of the received tensors, numpy's detaches of the header's bytes
    want = {"aten.empty.memory_format": 1, "c10d.recv_.default": 1, "aten.view.dtype": 1,
            "aten.as_strided.default": 1, "aten.detach.default": 2}
    assert recv["ops"] == want and recv["grad_ops"] == want, recv
