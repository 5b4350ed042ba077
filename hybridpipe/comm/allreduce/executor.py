"""Running one rank's share of an all-reduce schedule over isend/irecv.

:func:`run_pipelined` (gloo, CPU): every message is cut into chunks (the flat space's grid);
sends go out as soon as the chunk they read is final, and up to ``inflight`` receives are
posted ahead into a pool of buffers, so chunk c of round r+1 travels while chunk c+1 of round r
is still arriving (the ring's pipeline, the aggregator's cut-through). A send waits for the last
earlier receive that wrote its grid cell; a receive's write waits for the sends that read the
range it overwrites. A receive that can land in place (a copy with nothing to wait for) does,
others land in a pool buffer and are summed or copied when their turn comes. Receives are posted
and completed in one fixed order (rounds, then chunks) and sends go out per peer in order, so
what a rank waits for depends only on earlier rounds, or on receives of the same round that its
peers post without waiting: no cycle of waits (and the tests run every algorithm on 1..9 ranks).

:func:`run_rounds` (NCCL, or anywhere): round by round, whole messages, all of a round's sends
and receives posted, then waited; for each peer the lower position sends first, so that two
ranks exchanging on one NCCL pair stream never both block in a send.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce.flat import FlatSpace
from hybridpipe.comm.allreduce.schedule import Round
from hybridpipe.comm.allreduce.transport import GroupTransport, message_tag


@dataclass(eq=False)
class _Op:
    send: bool
    peer: int
    lo: int
    hi: int
    cell: int
    reduce: bool
    tag: int
    writers: list = field(default_factory=list)   # receives that must be applied first
    readers: list = field(default_factory=list)   # sends that must complete before our write
    work: dist.Work | None = None
    buf: torch.Tensor | None = None                # a pool buffer (receives to be summed)
    applied: bool = False                          # receives: value in place; sends: posted
    done: bool = False                             # work waited (gloo hangs on a second wait())

    def finish(self) -> None:
        if not self.done:
            if self.work is None:
                raise RuntimeError("all-reduce executor: an op was waited for before it was posted (a schedule bug)")
            self.work.wait()
            self.done = True

    def finished(self) -> bool:
        if not self.done and self.work is not None and self.work.is_completed():
            self.finish()
        return self.done


SERIAL_GRAIN = 32768     # elements: at::parallel_for's grain size; smaller ops run on the calling thread


def apply_landed(target: torch.Tensor, landed: torch.Tensor, reduce: bool) -> None:
    """``target += landed`` (or copy) on the calling thread alone.

    A CPU op above the grain size wakes torch's OpenMP team; with several ranks per core the
    team's spin-wait then starves gloo's I/O threads (our chunked sums made 1 MB all-reduces
    10x slower under torchrun, where OMP_NUM_THREADS is not set to 1 for one process per host).
    Slices at the grain size run inline, for a few microseconds of call overhead per slice.
    """
    n = target.numel()
    if target.device.type != "cpu" or n <= SERIAL_GRAIN or torch.get_num_threads() == 1:
        target.add_(landed) if reduce else target.copy_(landed)
        return
    for lo in range(0, n, SERIAL_GRAIN):
        t, x = target[lo:lo + SERIAL_GRAIN], landed[lo:lo + SERIAL_GRAIN]
        t.add_(x) if reduce else t.copy_(x)


def _overlaps(a: _Op, lo: int, hi: int) -> bool:
    return a.lo < hi and lo < a.hi


def _expand(rounds: Sequence[Round], me: int, space: FlatSpace, lane: int, algorithm: str
            ) -> tuple[dict[int, deque], list[_Op]]:
    """This rank's ops, with dependencies, in order: per-peer send queues and the receive list.

    A send depends on the last receive that wrote its grid cell (an earlier round: a round's
    sends are registered before its receives); a receive, on the sends of earlier or the same
    round whose ranges it overwrites.
    """
    sends: dict[int, deque] = {}
    recvs: list[_Op] = []
    writer: dict[int, _Op] = {}
    readers: dict[int, list[_Op]] = {}
    for rnd in rounds:
        tag = message_tag(lane, algorithm, rnd.phase)
        for m in (m for m in rnd.msgs if m.src == me):
            for p in space.pieces(m.lo, m.hi):
                op = _Op(True, m.dst, p.lo, p.hi, p.cell, False, tag)
                if p.cell in writer:
                    op.writers.append(writer[p.cell])
                readers.setdefault(p.cell, []).append(op)
                sends.setdefault(m.dst, deque()).append(op)
        # interleave the messages' chunks, so a rank receiving from several peers sums chunk 0
        # from all of them first (the aggregator's cut-through), then chunk 1, ...
        mine_in = [m for m in rnd.msgs if m.dst == me]
        for piece_row in zip_longest(*[[(m, p) for p in space.pieces(m.lo, m.hi)] for m in mine_in]):
            for m, p in filter(None, piece_row):
                op = _Op(False, m.src, p.lo, p.hi, p.cell, m.reduce, tag)
                if p.cell in writer:
                    op.writers.append(writer[p.cell])
                cell_readers = readers.get(p.cell, [])
                op.readers = [r for r in cell_readers if _overlaps(r, p.lo, p.hi)]
                readers[p.cell] = [r for r in cell_readers if not _overlaps(r, p.lo, p.hi)]
                writer[p.cell] = op
                recvs.append(op)
    return sends, recvs


def run_pipelined(rounds: Sequence[Round], space: FlatSpace, transport: GroupTransport, *, lane: int,
                  algorithm: str, inflight: int, pool: list[torch.Tensor]) -> None:
    """Execute this rank's share of ``rounds`` on ``space`` (summing in place).

    ``pool``: ``inflight`` buffers of at least ``space.chunk`` elements (dtype and device of the
    space) that receives to be summed land in.
    """
    sends, recvs = _expand(rounds, transport.position, space, lane, algorithm)
    free = list(pool)
    posted: deque[_Op] = deque()
    in_flight: deque[_Op] = deque()
    nxt = 0

    def issue_sends() -> bool:
        issued = False
        for peer, queue in sends.items():
            while queue and all(w.applied for w in queue[0].writers):
                op = queue.popleft()
                op.work = transport.isend(space.view(op.lo, op.hi), peer, op.tag)
                op.applied = True
                in_flight.append(op)
                issued = True
        return issued

    def post_recvs() -> bool:
        nonlocal nxt
        posted_any = False
        while nxt < len(recvs) and len(posted) < inflight:
            op = recvs[nxt]
            direct = not op.reduce and all(w.applied for w in op.writers) and all(
                r.finished() for r in op.readers)
            if direct:                     # a copy with nothing left to wait for lands in place
                target = space.view(op.lo, op.hi)
            else:                          # else into a pool buffer, applied in order later
                if not free:
                    break
                op.buf = free.pop()
                target = op.buf[: op.hi - op.lo]
            op.work = transport.irecv(target, op.peer, op.tag)
            posted.append(op)
            nxt += 1
            posted_any = True
        return posted_any

    while nxt < len(recvs) or posted or any(sends.values()):
        while issue_sends() | post_recvs():
            pass
        if posted:
            op = posted.popleft()
            op.finish()
            if op.buf is not None:
                for r in op.readers:
                    if r.work is None:
                        raise RuntimeError("all-reduce executor: a send reading a range was not issued before "
                                           "the range's next write (a schedule bug)")
                    r.finish()
                apply_landed(space.view(op.lo, op.hi), op.buf[: op.hi - op.lo], op.reduce)
                free.append(op.buf)
                op.buf = None
            op.applied = True
        elif in_flight:
            in_flight.popleft().finish()
        elif nxt < len(recvs) or any(sends.values()):
            raise RuntimeError("all-reduce executor stalled: every op waits on one not posted (a schedule bug)")
    for op in in_flight:
        op.finish()


def run_rounds(rounds: Sequence[Round], space: FlatSpace, transport: GroupTransport, *, lane: int,
               algorithm: str) -> None:
    """Execute round by round (whole messages; any backend, deadlock-free on NCCL)."""
    me = transport.position
    for rnd in rounds:
        tag = message_tag(lane, algorithm, rnd.phase)
        outs = {m.dst: m for m in rnd.msgs if m.src == me}
        ins = {m.src: m for m in rnd.msgs if m.dst == me}
        works, landed = [], []
        for peer in sorted(set(outs) | set(ins)):
            ops = []
            if peer in outs:
                m = outs[peer]
                ops += [("send", [(p, space.view(p.lo, p.hi)) for p in space.pieces(m.lo, m.hi)])]
            if peer in ins:
                m = ins[peer]
                bufs = [(p, torch.empty(p.hi - p.lo, dtype=space.dtype, device=space.device))
                        for p in space.pieces(m.lo, m.hi)]
                ops += [("recv", bufs)]
                landed.append((m, bufs))
            if me > peer:
                ops.reverse()
            for kind, parts in ops:
                for _, t in parts:
                    works.append(transport.isend(t, peer, tag) if kind == "send" else transport.irecv(t, peer, tag))
        for w in works:
            w.wait()
        for m, bufs in landed:
            for p, t in bufs:
                apply_landed(space.view(p.lo, p.hi), t, m.reduce)
