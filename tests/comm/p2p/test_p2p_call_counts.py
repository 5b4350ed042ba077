"""A steady-state message on a CPU ``sa`` channel (the default) costs a bounded number of Python
calls and aten ops: on the caller's thread for ``send`` and for ``recv`` (the hand-over from the
receive thread), and per frame in the receive thread. What benchmarks/p2p_calls.py counts; counts
do not depend on the load, so the bounds (the measured counts) are exact: a change that adds work
to every message fails here, one that removes some lowers them."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.comm.p2p import open_channels
from tests.comm.p2p.procs import expect_ok, run_ranks

WARMUP, COUNTED = 16, 32
C_SEND, C_THREAD = 26, 13         # C built-in calls per send and per frame in the receive thread
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
    send 3 aten ops (an activation) and 30 C built-ins, the receive thread 19 C built-ins a frame."""
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
    # Channels.recv, SaLink.take, QueueBox.take_if; no aten op: the tensors were made by the receive thread
    assert recv["calls"] == 3 and recv["ops"] == {}, recv
    # FrameReceiver.receive, decode_header, Header(), _post, unflatten, Frame(), Link._received, and
    # _recv_loop's next receive
    assert recv["thread_calls"] == 8, recv
    # the receive thread's C built-ins per frame: no clock read (was 2 perf_counter), the wait for
    # the next frame with the link's fixed idle bound (was 2 monotonic, a max and a min): 19 -> 13
    assert recv["thread_c_calls"] == C_THREAD, recv
