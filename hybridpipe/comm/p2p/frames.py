"""Posting and completing frames (see wire.py) on one route with torch.distributed ops.

:class:`FrameSender` and :class:`FrameReceiver` own one direction of one lane: its frame
sequence numbers, its metadata cache, its side stream and (CPU) the capacity of the flat
message the receiver keeps posted (see wire.py). They are used by one thread at a time each
(a sender's ``post`` and ``complete`` may run on different threads). Every wait has a
deadline; backend failures become :class:`P2PError` naming the peer and what was awaited.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import wire
from hybridpipe.comm.p2p.device import SideStream, wait_event
from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout, ProtocolError, classify_transport_error
from hybridpipe.comm.p2p.groups import Route
from hybridpipe.comm.p2p.wire import Flag, Header

Clock = Callable[[], float]
_MAX_WAIT_S = 7 * 24 * 3600.0
_FILLER = torch.zeros(1, dtype=torch.uint8)     # satisfies a posted flat receive the frame does not use
_FLAT_TAG = 1       # CPU: flat messages match among themselves, apart from headers and metadata (tag 0)


@dataclass
class Posted:
    """Operations of one frame in flight (keeps the tensors alive until completed)."""

    header: Header
    control_works: list
    data_works: list
    tensors: list = field(default_factory=list)
    t0: float = 0.0


@dataclass
class Frame:
    header: Header
    tensors: dict[str, torch.Tensor]
    event: torch.cuda.Event | None
    t0: float     # header arrived
    t1: float     # last payload arrived

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def nbytes(self) -> int:
        return self.header.payload_bytes


def _wait_work(work, deadline: float) -> None:
    left = min(max(deadline - time.monotonic(), 0.001), _MAX_WAIT_S)
    work.wait(datetime.timedelta(seconds=left))


class _End:
    def __init__(self, route: Route, peer: int, stream: SideStream, clock: Clock, prepost: bool = True) -> None:
        self.route = route
        self.peer = peer
        self.stream = stream
        self.clock = clock
        self.seq = 0
        self.cache = wire.MetaCache()
        self.meta_frames = 0        # frames that carried (re-)announced metadata
        self.cuda = stream.stream is not None
        self.capacity = 0           # CPU: bytes of the flat receive posted ahead for the next frame
        self.prepost = prepost and not self.cuda    # both ends of a lane must agree

    def _grow(self, header: Header, flat: int) -> None:
        """After a frame: the capacity both ends derive for the next one (never for HELLO/CLOSE)."""
        if self.prepost and not header.flags & (Flag.CLOSE | Flag.HELLO):
            self.capacity = max(self.capacity, flat)

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
    """Send side of one lane to one peer."""

    def post(self, key: str, msg: int, parts: int, items: Sequence[tuple[str, torch.Tensor]],
             flags: Flag = Flag.NONE, ready: torch.cuda.Event | None = None) -> Posted:
        """Post a frame's operations without waiting. ``items`` must be contiguous tensors."""
        metas = wire.describe(items)
        meta = b""
        if not flags & (Flag.CLOSE | Flag.HELLO) and self.cache.changed(key, metas):
            flags |= Flag.META
            meta = wire.encode_meta(metas)
            self.meta_frames += 1
        header = Header(flags, self.seq, msg, parts, len(items), len(meta), wire.payload_bytes(metas), key)
        self.seq += 1
        t0 = self.clock()
        what = f"send {key!r}"
        try:
            control = [dist.isend(wire.to_bytes_tensor(wire.encode_header(header)), self.peer,
                                  group=self.route.control)]
            if meta:
                control.append(dist.isend(wire.to_bytes_tensor(meta), self.peer, group=self.route.control))
            if self.cuda:
                data = []
                with self.stream.active(after=ready):
                    for _, t in items:
                        if t.numel():
                            data.append(dist.isend(t, self.peer, group=self.route.data))
                keep = [t for _, t in items]
            else:
                data, keep = self._post_flat(header, items, metas)
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        return Posted(header, control, data, keep, t0)

    def _post_flat(self, header: Header, items, metas) -> tuple[list, list]:
        """CPU: the frame's flat message into the receive posted ahead (capacity), or a filler
        for that receive and then the message alone (see wire.py)."""
        flat = wire.flatten(items, metas)
        size = 0 if flat is None else flat.numel()
        sends = []
        if self.capacity and not 0 < size <= self.capacity:
            sends.append(_FILLER)
        if flat is not None:
            sends.append(flat)
        self._grow(header, size)
        return [dist.isend(t, self.peer, group=self.route.data, tag=_FLAT_TAG) for t in sends], sends

    def complete(self, posted: Posted, deadline: float) -> float:
        """Wait until the frame has left; return the completion time (clock)."""
        self._complete(posted.control_works, posted.data_works, deadline, f"send {posted.header.key!r}")
        posted.tensors.clear()
        return self.clock()


class FrameReceiver(_End):
    """Receive side of one lane from one peer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ahead: tuple | None = None        # receives posted for the next frame

    def receive(self, deadline: float, what: str = "the next message") -> Frame:
        """Receive the next frame: header, metadata if announced, payloads."""
        if self._ahead is None:
            self._ahead = self._post_ahead(what)
        buf, head_work, flat_buf, flat_work = self._ahead
        try:
            _wait_work(head_work, deadline)
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        self._ahead = None
        t0 = self.clock()
        header = self._decode(wire.from_bytes_tensor(buf), what)
        if header.flags & (Flag.CLOSE | Flag.HELLO):
            if flat_work is not None:           # the sender's filler for the posted receive
                self._complete([], [flat_work], deadline, what)
            if not header.flags & Flag.CLOSE:
                self._ahead = self._post_ahead(what)
            return Frame(header, {}, None, t0, t0)
        metas = self._metas(header, deadline)
        what = f"recv {header.key!r}"
        if self.cuda:
            return self._receive_cuda(header, metas, deadline, what, t0)
        _, size = wire.flat_layout(metas)
        fits = flat_work is not None and 0 < size <= self.capacity
        works = [] if flat_work is None else [flat_work]
        if not fits and size:
            flat_buf = torch.empty(size, dtype=torch.uint8)
            try:
                works.append(dist.irecv(flat_buf, self.peer, group=self.route.data, tag=_FLAT_TAG))
            except Exception as e:      # noqa: BLE001
                raise classify_transport_error(e, self.peer, what) from e
        self._complete([], works, deadline, what)
        self._grow(header, size)
        self._ahead = self._post_ahead(what)    # the next frame may flow while this one is delivered
        tensors = wire.unflatten(flat_buf if size else None, metas)
        return Frame(header, tensors, None, t0, self.clock())

    def _post_ahead(self, what: str) -> tuple:
        """Post the next frame's header receive and, on CPU with a known capacity, its flat one."""
        buf = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8)
        flat = flat_work = None
        try:
            work = dist.irecv(buf, self.peer, group=self.route.control)
            if not self.cuda and self.capacity:
                flat = torch.empty(self.capacity, dtype=torch.uint8)
                flat_work = dist.irecv(flat, self.peer, group=self.route.data, tag=_FLAT_TAG)
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        return buf, work, flat, flat_work

    def _receive_cuda(self, header: Header, metas, deadline: float, what: str, t0: float) -> Frame:
        tensors: dict[str, torch.Tensor] = {}
        works = []
        try:
            with self.stream.active():
                for m in metas:
                    t = torch.empty(m.shape, dtype=m.dtype, device=self.stream.device)
                    tensors[m.name] = t
                    if t.numel():
                        works.append(dist.irecv(t, self.peer, group=self.route.data))
        except Exception as e:          # noqa: BLE001
            raise classify_transport_error(e, self.peer, what) from e
        event = self._complete([], works, deadline, what)
        return Frame(header, tensors, event, t0, self.clock())

    def _decode(self, raw: bytes, what: str) -> Header:
        try:
            header = wire.decode_header(raw)
        except wire.WireError as e:
            raise ProtocolError(self.peer, what, str(e)) from None
        if header.seq != self.seq:
            raise ProtocolError(self.peer, what, f"frame {header.seq} arrived where frame {self.seq} was "
                                "expected on this lane; both ranks must open channels with the same mode")
        self.seq += 1
        return header

    def _metas(self, header: Header, deadline: float) -> tuple[wire.TensorMeta, ...]:
        what = f"recv {header.key!r}"
        if header.flags & Flag.META:
            buf = torch.empty(header.meta_len, dtype=torch.uint8)
            try:
                _wait_work(dist.irecv(buf, self.peer, group=self.route.control), deadline)
            except Exception as e:      # noqa: BLE001
                raise classify_transport_error(e, self.peer, what) from e
            try:
                metas = wire.decode_meta(wire.from_bytes_tensor(buf))
            except wire.WireError as e:
                raise ProtocolError(self.peer, what, str(e)) from None
            self.cache.update(header.key, metas)
            self.meta_frames += 1
        else:
            cached = self.cache.get(header.key)
            if cached is None:
                raise ProtocolError(self.peer, what, f"no tensor metadata was announced for key kind "
                                    f"{wire.kind_of(header.key)!r}")
            metas = cached
        if len(metas) != header.n_tensors or wire.payload_bytes(metas) != header.payload_bytes:
            raise ProtocolError(self.peer, what, f"header announces {header.n_tensors} tensors / "
                                f"{header.payload_bytes} bytes, metadata {len(metas)} / "
                                f"{wire.payload_bytes(metas)}")
        return metas
