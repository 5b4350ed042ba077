"""The aggregator's cut-through sum of one all-reduce, as a single-threaded event loop.

Every worker streams its vector; chunk c of the sum is added up (in position order, so the
result is the same on every run) as soon as chunk c has arrived from every worker, and is
streamed back to all of them while later chunks are still arriving. Each worker has a pool of
``buffers`` receive buffers (when it is empty the loop stops reading that worker and TCP holds
it back) and the sums have a pool of ``buffers`` more. One thread and non-blocking sockets:
no hand-over between threads, which on a loaded machine costs more than the work itself.
"""

from __future__ import annotations

import selectors
import socket
from collections import deque
from dataclasses import dataclass

import torch

from hybridpipe.comm.allreduce.dedicated.wire import byte_view, wake_after


class StreamError(ConnectionError):
    """A worker left or went silent during an all-reduce."""


@dataclass(slots=True)
class _Receiving:
    """Where one worker's stream is: its chunk, the buffer being filled (None: none taken yet),
    the bytes in it, the socket's wake-up level."""

    index: int = 0
    buf: torch.Tensor | None = None
    got: int = 0
    level: int = 0


def reduce_stream(conns: list[socket.socket], dtype: torch.dtype, numel: int, chunk_elems: int, buffers: int,
                  timeout_s: float) -> None:
    """Receive ``numel`` elements from every connection, send their sum back to every one."""
    n = len(conns)
    item = dtype.itemsize
    chunks = [(lo, min(lo + chunk_elems, numel)) for lo in range(0, numel, chunk_elems)]
    free = [[torch.empty(chunk_elems, dtype=dtype) for _ in range(buffers)] for _ in conns]
    ready: list[deque] = [deque() for _ in conns]
    receiving = [_Receiving() for _ in conns]
    sending: list[deque] = [deque() for _ in conns]   # [sum index, bytes sent]
    sums = [torch.empty(chunk_elems, dtype=dtype) for _ in range(buffers)]
    sum_free = list(range(buffers))
    sum_chunk: dict[int, int] = {}                    # sum index -> chunk index
    sum_left: dict[int, int] = {}                     # sum index -> workers still to send it to
    next_sum = 0
    done = [0] * n                                    # chunks fully sent back per worker
    selector = selectors.DefaultSelector()
    watching = [0] * n                                # events registered per connection
    for c, state in zip(conns, receiving, strict=True):
        c.setblocking(False)
        state.level = wake_after(c, (chunks[0][1] - chunks[0][0]) * item if chunks else 1, 0)
    try:
        while min(done) < len(chunks):
            for i, c in enumerate(conns):
                want = 0
                if receiving[i].index < len(chunks) and (receiving[i].buf is not None or free[i]):
                    want |= selectors.EVENT_READ      # (a worker that left is seen when read again)
                if sending[i]:
                    want |= selectors.EVENT_WRITE
                if want != watching[i]:
                    if not watching[i]:
                        selector.register(c, want, i)
                    elif not want:
                        selector.unregister(c)
                    else:
                        selector.modify(c, want, i)
                    watching[i] = want
            events = selector.select(timeout_s)
            if not events:
                raise StreamError(f"no worker sent or took data for {timeout_s:.0f} s")
            for key, mask in events:
                i = key.data
                if mask & selectors.EVENT_READ:
                    _receive(conns[i], receiving[i], free[i], ready[i], chunks, item)
                if mask & selectors.EVENT_WRITE and sending[i]:
                    entry = sending[i][0]
                    lo, hi = chunks[sum_chunk[entry[0]]]
                    view = byte_view(sums[entry[0]])[: (hi - lo) * item]
                    try:
                        entry[1] += conns[i].send(view[entry[1]:])
                    except BlockingIOError:
                        continue
                    if entry[1] == len(view):
                        sending[i].popleft()
                        done[i] += 1
                        sum_left[entry[0]] -= 1
                        if sum_left[entry[0]] == 0:
                            sum_free.append(entry[0])
            while next_sum < len(chunks) and sum_free and all(ready):
                k = sum_free.pop()
                lo, hi = chunks[next_sum]
                out = sums[k][: hi - lo]
                for i in range(n):
                    buf = ready[i].popleft()
                    out.copy_(buf[: hi - lo]) if i == 0 else out.add_(buf[: hi - lo])
                    free[i].append(buf)
                sum_chunk[k], sum_left[k] = next_sum, n
                for q in sending:
                    q.append([k, 0])
                next_sum += 1
    finally:
        selector.close()
        for c, state in zip(conns, receiving, strict=True):
            try:
                wake_after(c, 1, state.level)
                c.setblocking(True)
            except OSError:
                pass


def _receive(conn: socket.socket, state: _Receiving, free: list, ready: deque, chunks: list, item: int) -> None:
    index, buf, got, level = state.index, state.buf, state.got, state.level
    if buf is None:
        buf = free.pop()
    lo, hi = chunks[index]
    view = byte_view(buf)[: (hi - lo) * item]
    try:
        n = conn.recv_into(view[got:])
    except BlockingIOError:
        state.buf = buf
        return
    if n == 0:
        raise StreamError("a worker left mid-operation")
    got += n
    if got == len(view):
        ready.append(buf)
        index, buf, got = index + 1, None, 0
    left = (chunks[index][1] - chunks[index][0]) * item - got if index < len(chunks) else 1
    state.index, state.buf, state.got, state.level = index, buf, got, wake_after(conn, left, level)
