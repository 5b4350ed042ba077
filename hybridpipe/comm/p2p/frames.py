"""Posting and completing frames (see wire.py) on one route with torch.distributed ops.

:class:`FrameSender` and :class:`FrameReceiver` own one direction of one lane: its frame
sequence numbers, its metadata cache, its side stream and the capacity of the receive the
receiver keeps posted (see wire.py: both ends derive it from the frames so far, so a frame
that fits travels as one message). They are used by one thread at a time each (a sender's
``post`` and ``complete`` may run on different threads). Every wait has a deadline; backend
failures become :class:`P2PError` naming the peer and what was awaited.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import layouts, wire
from hybridpipe.comm.p2p.device import SideStream, wait_event
from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout, ProtocolError, classify_transport_error
from hybridpipe.comm.p2p.groups import Route
from hybridpipe.comm.p2p.wire import Flag, Header

Clock = Callable[[], float]
Wait = datetime.timedelta
_MAX_WAIT_S = 7 * 24 * 3600.0
_NO_PAYLOAD = Flag.CLOSE | Flag.HELLO
_SPARE_SIZES = 8            # frame lengths a sender keeps buffers for (the most recently used)
_KNOWN_KEYS = 4096          # a receiver's remembered (key, tensors) -> layout (a step's keys repeat)
_SPARE_PER_SIZE = 2         # buffers per length: the frame in flight and the one being packed


class Posted:
    """Operations of one frame in flight (keeps the tensors alive until completed)."""

    __slots__ = ("key", "nbytes", "control_works", "data_works", "tensors", "t0", "done")

    def __init__(self, key: str, nbytes: int, control_works: list, data_works: list, tensors: list,
                 t0: float = 0.0) -> None:
        self.key = key                  # the message's key
        self.nbytes = nbytes            # its payload bytes
        self.control_works = control_works
        self.data_works = data_works
        self.tensors = tensors
        self.t0 = t0
        self.done = False               # completed: its buffers may be reused


class Frame:
    """A received frame: what the receive threads deliver (``sa``, ``sra``: as the message itself)."""

    __slots__ = ("header", "key", "tensors", "event", "t0", "t1")

    def __init__(self, header: Header, tensors: dict[str, torch.Tensor], event: torch.cuda.Event | None,
                 t0: float, t1: float) -> None:
        self.header = header
        self.key = header.key
        self.tensors = tensors
        self.event = event
        self.t0 = t0            # header arrived
        self.t1 = t1            # last payload arrived

    @property
    def events(self) -> tuple:
        """The CUDA events to wait for before using the tensors (a message's, see links.Message)."""
        return (self.event,)

    @property
    def nbytes(self) -> int:
        return self.header.payload_bytes


def post_send(t: torch.Tensor, group: dist.ProcessGroup, group_peer: int):
    """``dist.isend`` of a contiguous tensor to ``group_peer`` (the peer's rank *in* ``group``),
    straight on the group: the frames' sends and receives skip the wrapper's per-call checks
    and rank translation (the route's ranks are fixed when the channel opens)."""
    return group.send([torch.view_as_real(t) if t.is_complex() else t], group_peer, 0)


def post_recv(t: torch.Tensor, group: dist.ProcessGroup, group_peer: int):
    """``dist.irecv`` into contiguous ``t`` from ``group_peer`` (see :func:`post_send`)."""
    return group.recv([torch.view_as_real(t) if t.is_complex() else t], group_peer, 0)


def _left(deadline: float) -> Wait:
    """What is left until ``deadline`` (monotonic), as a backend wait's timeout."""
    return datetime.timedelta(seconds=min(max(deadline - time.monotonic(), 0.001), _MAX_WAIT_S))


def fixed_wait(seconds: float) -> Wait:
    """A backend wait's timeout of ``seconds`` (capped as every wait here), made once."""
    return datetime.timedelta(seconds=min(max(seconds, 0.001), _MAX_WAIT_S))


def _wait_work(work, deadline: float) -> None:
    work.wait(_left(deadline))


class _End:
    def __init__(self, route: Route, peer: int, stream: SideStream, clock: Clock | None,
                 prepost: bool = True) -> None:
        self.route = route
        self.peer = peer
        self.stream = stream
        self.clock = clock          # None: nobody reads transfer times (no on_transfer): no clock reads, times 0.0
        self.seq = 0
        self.cache = layouts.MetaCache()
        self.meta_frames = 0        # frames that carried (re-)announced metadata
        self.split_frames = 0       # frames that took more than one message on the control group
        self.cuda = stream.stream is not None
        self.capacity = wire.MIN_CAPACITY   # the receive posted for the next frame (both ends agree)
        self.prepost = prepost      # receiver: keep the next frame's receive posted (sa, per-tensor)
        self.control_peer = dist.get_group_rank(route.control, peer)
        self.data_peer = dist.get_group_rank(route.data, peer)

    def _complete(self, control_works: list, data_works: list, deadline: float,
                  what: str) -> torch.cuda.Event | None:
        """Wait for control ops on the CPU and for data ops (on CUDA via an event on the side
        stream, which is returned: it marks the data as usable)."""
        try:
            for w in control_works:
                _wait_work(w, deadline)
            if not self.cuda:
                for w in data_works:
                    _wait_work(w, deadline)
                return None
            with self.stream.active():
                for w in data_works:
                    w.wait()            # NCCL: orders the side stream after the transfer
            event = self.stream.record()
            done = wait_event(event, deadline)
        except P2PError:
            raise
        except Exception as e:          # noqa: BLE001 - backend errors have no common type
            raise classify_transport_error(e, self.peer, what) from e
        if not done:
            raise P2PTimeout(self.peer, what, "the transfer did not finish in time")
        return event


class FrameSender(_End):
    """Send side of one lane to one peer.

    A whole frame's buffer is kept for a later frame of the same length once its send has
    completed (``Posted.done``): a buffer still in flight is never written, a new one is made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # per frame length, most recently used last: its buffers and the frame each last carried
        self._spare: dict[int, list[tuple[wire.FrameBuffer, Posted | None]]] = {}

    def _buffer(self, size: int) -> tuple[wire.FrameBuffer, list[tuple[wire.FrameBuffer, Posted | None]]]:
        """A buffer of ``size`` bytes whose last frame has left (or a new one), and its length's slots."""
        spare = self._spare
        slots = spare.pop(size, None)
        if slots is None:
            if len(spare) >= _SPARE_SIZES:
                del spare[next(iter(spare))]        # the length used longest ago
            slots = []
        spare[size] = slots                         # most recently used last
        for i, (fb, owner) in enumerate(slots):
            if owner is None or owner.done:
                del slots[i]
                return fb, slots
        if len(slots) >= _SPARE_PER_SIZE:
            del slots[0]        # still in flight: its Posted keeps the buffer alive until completed
        return wire.FrameBuffer(size), slots

    def post(self, key: str, msg: int, parts: int, items: Sequence[tuple[str, torch.Tensor]],
             flags: int = Flag.NONE, ready: torch.cuda.Event | None = None) -> Posted:
        """Post a frame's operations without waiting. ``items`` must be contiguous tensors."""
        if flags & _NO_PAYLOAD:
            layout, changed = layouts.layout_of(wire.describe(items)), False
        else:
            layout, changed = self.cache.sent(key, items)
        meta = b""
        if changed:
            flags |= Flag.META
            meta = wire.encode_meta(layout.metas)
            self.meta_frames += 1
        cuda = self.cuda
        body = 0 if cuda else layout.body_bytes
        meta_len = len(meta)
        start, size, inline, self.capacity = wire.placement(meta_len, body, self.capacity)   # as the receiver's
        if not inline:
            flags |= Flag.SPLIT
            self.split_frames += 1
        seq = self.seq
        self.seq = seq + 1
        header = (flags, seq, msg, parts, len(items), meta_len, layout.payload_bytes, body, key)    # a Header's fields
        t0 = clock() if (clock := self.clock) is not None else 0.0
        group, group_peer = self.route.control, self.control_peer
        try:
            if inline:
                fb, slots = self._buffer(size)
                sends = [fb.pack(header, meta, () if cuda else items, layout, start)]
                control = [post_send(sends[0], group, group_peer)]
            else:
                slots = None
                sends = [wire.to_bytes_tensor(wire.encode_header(Header(*header)))]
                if meta:
                    sends.append(wire.to_bytes_tensor(meta))
                if (flat_body := wire.flatten(items, layout.metas) if body else None) is not None:
                    sends.append(flat_body)
                control = [post_send(t, group, group_peer) for t in sends]
            data = []
            if cuda:
                with self.stream.active(after=ready):
                    for _, t in items:
                        if t.numel():
                            data.append(post_send(t, self.route.data, self.data_peer))
                sends += [t for _, t in items]
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, f"send {key!r}") from e
        posted = Posted(key, layout.payload_bytes, control, data, sends, t0)
        if slots is not None:
            slots.append((fb, posted))
        return posted

    def complete(self, posted: Posted, deadline: float | None, wait: Wait | None = None) -> float:
        """Wait until the frame has left; return the completion time (clock; 0.0 without one).
        ``deadline`` None: wait at most ``wait`` in all (a bound fixed per link; a whole CPU frame,
        one operation, then reads no clock)."""
        if deadline is None:
            if wait is None:
                raise ValueError("complete needs a deadline or a wait")
            if self.cuda or posted.data_works or len(posted.control_works) > 1:
                deadline = time.monotonic() + wait.total_seconds()
        if self.cuda or posted.data_works:
            self._complete(posted.control_works, posted.data_works, deadline, f"send {posted.key!r}")  # type: ignore[arg-type]
        else:                   # CPU: the control group's works, inline
            try:
                for w in posted.control_works:
                    w.wait(wait if deadline is None else _left(deadline))
            except Exception as e:      # noqa: BLE001 - backend errors have no common type
                raise classify_transport_error(e, self.peer, f"send {posted.key!r}") from e
        posted.done = True
        posted.tensors.clear()
        return clock() if (clock := self.clock) is not None else 0.0


class FrameReceiver(_End):
    """Receive side of one lane from one peer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ahead: tuple[torch.Tensor, Any] | None = None     # the next frame's receive, posted
        # (key, tensors) -> the layout the metadata cache gave, checked against that frame's header:
        # a frame like it takes one lookup (emptied whenever metadata arrives)
        self._known: dict[tuple[str, int], layouts.Layout] = {}

    def receive(self, deadline: float | None, what: str = "the next message", wait: Wait | None = None) -> Frame:
        """Receive the next frame: one message, or a split frame's header, metadata and body.
        ``deadline`` None: wait at most ``wait`` for the frame (a receive thread's fixed bound: no
        clock read), and as long again for a split frame's rest."""
        if deadline is None and wait is None:
            raise ValueError("receive needs a deadline or a wait")
        if self._ahead is None:
            self._ahead = self._post(self.capacity, what)
        buf, work = self._ahead
        self._ahead = None
        try:
            work.wait(wait if deadline is None else _left(deadline))
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        clock = self.clock
        t0 = clock() if clock is not None else 0.0
        raw = buf.numpy()
        try:
            header = wire.decode_header(raw)
        except wire.WireError as e:
            raise ProtocolError(self.peer, what, str(e)) from None
        if header.seq != self.seq:
            raise ProtocolError(self.peer, what, f"frame {header.seq} arrived where frame {self.seq} was "
                                "expected on this lane; both ranks must open channels with the same mode")
        self.seq += 1
        flags = header.flags
        base, _, _, self.capacity = wire.placement(header.meta_len, header.body_bytes, self.capacity)
        if flags & _NO_PAYLOAD:
            if self.prepost and not flags & Flag.CLOSE:
                self._ahead = self._post(self.capacity, what)
            return Frame(header, {}, None, t0, t0)
        what = f"recv {header.key!r}"
        if deadline is None and (flags & Flag.SPLIT or self.cuda):
            deadline = time.monotonic() + wait.total_seconds()     # type: ignore[union-attr]
        if flags & Flag.SPLIT:
            meta, body, base = self._receive_rest(header, deadline, what)  # type: ignore[arg-type]
        else:
            meta = raw[wire.HEADER_BYTES:wire.HEADER_BYTES + header.meta_len] if header.meta_len else b""
            body = buf
            if self.prepost and self.cuda:      # the next frame may flow while this one's data arrives
                self._ahead = self._post(self.capacity, what)
        layout = self._known.get((header.key, header.n_tensors)) if not flags & Flag.META else None
        if layout is None or layout.payload_bytes != header.payload_bytes:
            layout = self._layout(header, meta)
        if self.cuda:
            return self._receive_cuda(header, layout.metas, deadline, what, t0)  # type: ignore[arg-type]
        if layout.body_bytes != header.body_bytes:
            raise ProtocolError(self.peer, what, f"header announces a body of {header.body_bytes} bytes, "
                                f"the metadata {layout.body_bytes}")
        tensors = wire.unflatten(body if header.body_bytes else None, layout.metas, base, layout.offsets)
        if self.prepost and not flags & Flag.SPLIT:     # (a split frame's rest posted it)
            # posted once this frame is read, not at once: by then the transport's thread that
            # delivered it has let go of the connection (posting contended for its lock). A peer
            # that died after sending this frame fails the next receive, not this one
            try:
                self._ahead = self._post(self.capacity, what)
            except P2PError:
                self._ahead = None      # posted again (and failing) by the next receive
        return Frame(header, tensors, None, t0, clock() if clock is not None else 0.0)

    def _post(self, size: int, what: str) -> tuple[torch.Tensor, Any]:
        buf = wire.receive_buffer(size)
        try:
            return buf, self.route.control.recv([buf], self.control_peer, 0)     # uint8: as post_recv's
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e

    def _receive_rest(self, header: Header, deadline: float, what: str) -> tuple[object, torch.Tensor | None, int]:
        """A split frame: its metadata and body, each a message of the size the header gives
        (posted before the next frame's receive: gloo matches a peer's messages in order)."""
        self.split_frames += 1
        meta = self._post(header.meta_len, what) if header.meta_len else None
        body = self._post(header.body_bytes, what) if header.body_bytes else None
        if self.prepost:
            self._ahead = self._post(self.capacity, what)
        self._complete([p[1] for p in (meta, body) if p is not None], [], deadline, what)
        return (b"" if meta is None else meta[0].numpy()[:header.meta_len]), (None if body is None else body[0]), 0

    def _receive_cuda(self, header: Header, metas, deadline: float, what: str, t0: float) -> Frame:
        tensors: dict[str, torch.Tensor] = {}
        works = []
        try:
            with self.stream.active():
                for m in metas:
                    t = torch.empty(m.shape, dtype=m.dtype, device=self.stream.device)
                    tensors[m.name] = t
                    if t.numel():
                        works.append(post_recv(t, self.route.data, self.data_peer))
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        event = self._complete([], works, deadline, what)
        return Frame(header, tensors, event, t0, clock() if (clock := self.clock) is not None else 0.0)

    def _layout(self, header: Header, meta) -> layouts.Layout:
        if header.flags & Flag.META:
            try:
                metas = wire.decode_meta(meta)
            except wire.WireError as e:
                raise ProtocolError(self.peer, f"recv {header.key!r}", str(e)) from None
            self.cache.update(header.key, metas)
            self.meta_frames += 1
            self._known.clear()
        layout = self.cache.layout(header.key, header.n_tensors)
        if layout is None:
            raise ProtocolError(self.peer, f"recv {header.key!r}", f"no tensor metadata was announced for key "
                                f"kind {wire.kind_of(header.key)!r} with {header.n_tensors} tensors")
        if len(layout.metas) != header.n_tensors or layout.payload_bytes != header.payload_bytes:
            raise ProtocolError(self.peer, f"recv {header.key!r}", f"header announces {header.n_tensors} tensors / "
                                f"{header.payload_bytes} bytes, metadata {len(layout.metas)} / "
                                f"{layout.payload_bytes}")
        if len(self._known) >= _KNOWN_KEYS:
            self._known.clear()
        self._known[header.key, header.n_tensors] = layout
        return layout
