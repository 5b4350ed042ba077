"""What travels on a lane: frames, each one message on the wire (pure: bytes in, bytes out).

A *frame* is the unit a lane carries in FIFO order. Its bytes, in one uint8 buffer::

    header (HEADER_BYTES)  [metadata (meta_len bytes) if Flag.META]  [pad to 64]  body (body_bytes)

The header names the message (its key, e.g. ``"act/3"``, and its number on this link
direction), says how many tensors the frame and the whole message carry, how many payload
bytes they have and how long the metadata and the body are. Metadata (names, dtypes, shapes)
travels only when it differs from what was last sent for the same *key kind*
(``kind_of("act/0/3") == "act/0"``) and tensor count on the same lane: both ends keep the same cache because
the lane is FIFO, so a changed shape is re-announced by the very frame that carries it and can
never be mis-received. The *body* is the frame's tensors packed at 64-byte aligned offsets
(:func:`flat_layout`); on CUDA lanes the payloads travel on their own (NCCL) and the body is
empty.

One frame is one gloo message: the receiver keeps a receive posted into a buffer of the
lane's *capacity* (gloo accepts a shorter message into a larger buffer), and a frame that fits
(:func:`inline_bytes` <= capacity, body at most ``INLINE_LIMIT``) is sent whole into it. Both
ends derive the capacity from the frames already on the lane (:func:`next_capacity`, from
``MIN_CAPACITY``), so they agree without asking. A frame that does not fit is *split*
(``Flag.SPLIT``): the header alone (it always fits), then the metadata and the body as
messages of their own, whose sizes the header gives; the capacity then grows so that the next
frame like it fits. A body above ``INLINE_LIMIT`` always travels apart, from its own memory (a
single tensor is not copied), where copying it would cost more than the extra message.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

MAGIC = b"HPp2"
VERSION = 3
HEADER_BYTES = 128
# magic, version, flags, frame seq, message number, tensors in message, tensors in frame,
# metadata length, payload bytes, body bytes, key length
_FIXED = struct.Struct("<4sHHQQIIIQQH")
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size
_WHOLE = struct.Struct(_FIXED.format + f"{MAX_KEY_BYTES}s")     # the fixed fields and the key's room
FLAT_ALIGN = 64
MIN_CAPACITY = 4096             # what a lane's receiver posts before any frame has grown it
INLINE_LIMIT = 1 << 20          # a body above this travels apart, from its own memory
RAW_COPY_LIMIT = 1 << 16        # a tensor up to this is packed by a plain memory copy (no aten op)
_memmove, _Tensor = ctypes.memmove, torch.Tensor


class WireError(ValueError):
    """Malformed or inconsistent bytes on a lane (the channel turns it into ProtocolError)."""


class Flag:
    """A frame's flags: bits of the header's ``flags`` int (plain ints: tested on every frame)."""

    NONE = 0
    META = 1    # metadata follows the header and replaces the cached one for this key kind
    CLOSE = 2   # the sender closed its channels; nothing follows on this lane
    HELLO = 4   # first frame of a lane: the key carries the sender's configuration
    SPLIT = 8   # the header travelled alone: metadata and body follow as messages of their own
    ALL = (NONE, META, CLOSE, HELLO, SPLIT)


class Header(NamedTuple):
    flags: int          # Flag bits
    seq: int            # frame number on this lane, from 0
    msg: int            # message number on this link direction, from 0
    parts: int          # tensors in the whole message (all lanes)
    n_tensors: int      # tensors carried by this frame
    meta_len: int       # bytes of metadata following the header (0 unless Flag.META)
    payload_bytes: int  # total payload bytes of this frame (cross-checked with the metadata)
    body_bytes: int     # bytes of the flat body (the packed payloads; 0 on CUDA lanes)
    key: str


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @functools.cached_property
    def strides(self) -> tuple[int, ...]:
        """The strides of a contiguous tensor of this shape (what :func:`unflatten` views)."""
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= max(d, 1)
        return tuple(reversed(out))


@functools.lru_cache(maxsize=4096)
def kind_of(key: str) -> str:
    """The metadata cache class of a key: the part before the last ``/`` (``"act/3"`` -> ``"act"``,
    ``"act/2/3"`` -> ``"act/2"``: the pipeline's keys name the producing stage, so two model chunks
    sharing a link keep a cache each; remembered: a run sends the same few hundred keys every step)."""
    return key.rsplit("/", 1)[0]


def check_key(key: str) -> bytes:
    """Encode ``key`` for a header; raise ValueError if it cannot be carried."""
    if type(key) is str:
        return _checked_key(key)
    return _check_key(key)


@functools.lru_cache(maxsize=4096)
def _checked_key(key: str) -> bytes:
    """:func:`_check_key` of a str, remembered (a run sends the same few hundred keys every step)."""
    return _check_key(key)


def _check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a channel key must be a non-empty string, got {key!r}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"channel key {key[:40]!r}... is {len(raw)} bytes; keys are at most "
                         f"{MAX_KEY_BYTES} bytes (use short keys such as 'act/3')")
    return raw


def encode_header(h: Header) -> bytes:
    """Serialise a header into exactly ``HEADER_BYTES`` bytes."""
    raw = check_key(h.key)
    fixed = _FIXED.pack(MAGIC, VERSION, int(h.flags), h.seq, h.msg, h.parts, h.n_tensors,
                        h.meta_len, h.payload_bytes, h.body_bytes, len(raw))
    return (fixed + raw).ljust(HEADER_BYTES, b"\0")


def decode_header(buf) -> Header:
    """Parse a header from the first ``HEADER_BYTES`` of ``buf`` (bytes, or a uint8 array: the
    start of a received frame); raise WireError if they are not one."""
    if len(buf) < HEADER_BYTES:
        raise WireError(f"header has {len(buf)} bytes, expected {HEADER_BYTES}")
    magic, version, flags, seq, msg, parts, n, meta_len, payload, body, key_len, room = _WHOLE.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: the peer is not speaking the hybridpipe p2p protocol "
                        "(or frames are misaligned)")
    if version != VERSION:
        raise WireError(f"peer speaks p2p protocol version {version}, this side {VERSION}; "
                        "run the same hybridpipe version on every rank")
    if key_len > MAX_KEY_BYTES:
        raise WireError(f"key length {key_len} exceeds {MAX_KEY_BYTES}")
    key = _key_of(room[:key_len])
    return Header(flags, seq, msg, parts, n, meta_len, payload, body, key)


@functools.lru_cache(maxsize=4096)
def _key_of(raw: bytes) -> str:
    """A received key's text, remembered (a run receives the same few hundred keys every step)."""
    return raw.decode("utf-8", errors="replace")


def describe(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[TensorMeta, ...]:
    """Metadata of named tensors, in order."""
    return tuple(TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in items)


def encode_meta(metas: Sequence[TensorMeta]) -> bytes:
    """Serialise metadata (compact JSON: ``[[name, dtype, shape], ...]``)."""
    rows = [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)] for m in metas]
    return json.dumps(rows, separators=(",", ":")).encode("utf-8")


def decode_meta(buf: bytes) -> tuple[TensorMeta, ...]:
    """Parse metadata written by :func:`encode_meta`; raise WireError if malformed."""
    try:
        rows = json.loads(bytes(buf).decode("utf-8"))
        metas = []
        for name, dtype_name, shape in rows:
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype) or not isinstance(name, str):
                raise TypeError(dtype_name)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise TypeError(shape)
            metas.append(TensorMeta(name, dtype, tuple(shape)))
        return tuple(metas)
    except (ValueError, TypeError, AttributeError) as e:
        raise WireError(f"unreadable tensor metadata ({type(e).__name__}: {e})") from None


def payload_bytes(metas: Sequence[TensorMeta]) -> int:
    return sum(m.nbytes for m in metas)



def flat_layout(metas: Sequence[TensorMeta]) -> tuple[tuple[int, ...], int]:
    """Byte offsets of each tensor in a frame's flat message, and its length (0: nothing to send)."""
    offsets, end = [], 0
    for m in metas:
        start = -(-end // FLAT_ALIGN) * FLAT_ALIGN if m.nbytes else end
        offsets.append(start)
        end = start + m.nbytes
    return tuple(offsets), end


def flatten(items: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]) -> torch.Tensor | None:
    """The flat message of contiguous CPU ``items`` (uint8; None when empty). A lone non-empty
    tensor at offset 0 is viewed, not copied."""
    offsets, total = flat_layout(metas)
    if total == 0:
        return None
    full = [(t.detach() if t.requires_grad else t, off)       # no graph on what is sent
            for (_, t), off in zip(items, offsets, strict=True) if t.numel()]
    if len(full) == 1:
        return _bytes_of(full[0][0])
    flat = torch.empty(total, dtype=torch.uint8)
    for t, off in full:
        b = _bytes_of(t)
        flat[off:off + b.numel()].copy_(b)
    return flat


def unflatten(flat: torch.Tensor | None, metas: Sequence[TensorMeta], base: int = 0,
              offsets: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Named tensors viewing a received body that starts at byte ``base`` of ``flat`` (no
    copies; they share its storage). ``offsets``: :func:`flat_layout`'s, if known."""
    if offsets is None:
        offsets, _ = flat_layout(metas)
    out = {}
    # flat viewed as the last tensor's dtype: one view per tensor (as_strided), not a slice and two views
    typed, size, origin = (flat, int(flat.numel()), int(flat.storage_offset())) if flat is not None else (None, 0, 0)
    for m, off in zip(metas, offsets, strict=True):
        nbytes, dtype = m.nbytes, m.dtype
        start = origin + base + off     # in flat's storage
        if nbytes == 0:
            out[m.name] = torch.empty(m.shape, dtype=dtype)
        elif flat is None or typed is None:
            raise WireError(f"tensor {m.name!r} has {nbytes} bytes but the message has none")
        elif (size | origin | start) % dtype.itemsize:   # not whole elements (received buffers are)
            out[m.name] = flat[base + off:base + off + nbytes].view(dtype).view(m.shape)
        else:
            if typed.dtype != dtype:
                typed = flat.view(dtype) if flat.dtype != dtype else flat
            out[m.name] = typed.as_strided(m.shape, m.strides, start // dtype.itemsize)
    return out


def receive_buffer(size: int) -> torch.Tensor:
    """A uint8 buffer to receive a message of at most ``size`` bytes into, a whole number of
    ``FLAT_ALIGN`` bytes long (so :func:`unflatten` can view it as any dtype)."""
    return torch.empty(-(-size // FLAT_ALIGN) * FLAT_ALIGN, dtype=torch.uint8)


def body_offset(meta_len: int, body_bytes: int) -> int:
    """Where a whole frame's body starts: after the header and metadata, 64-byte aligned."""
    head = HEADER_BYTES + meta_len
    return -(-head // FLAT_ALIGN) * FLAT_ALIGN if body_bytes else head


def inline_bytes(meta_len: int, body_bytes: int) -> int:
    """The length of a frame sent whole (one message)."""
    return body_offset(meta_len, body_bytes) + body_bytes


@functools.lru_cache(maxsize=1024)
def placement(meta_len: int, body_bytes: int, capacity: int) -> tuple[int, int, bool, int]:
    """A frame's ``(body offset, whole length, sent whole, next capacity)`` on a lane whose
    receive holds ``capacity`` bytes: whole when its body is at most ``INLINE_LIMIT`` and the
    frame fits (else split); both ends of the lane then use the next capacity, grown so that a
    frame like it fits whole (unless its body travels apart anyway). One call per frame on each end."""
    start = body_offset(meta_len, body_bytes)
    size = start + body_bytes
    small = body_bytes <= INLINE_LIMIT
    return start, size, small and size <= capacity, max(capacity, size) if small else capacity


def is_inline(meta_len: int, body_bytes: int, capacity: int) -> bool:
    """Whether a frame goes whole into a receive of ``capacity`` bytes (else it is split)."""
    return placement(meta_len, body_bytes, capacity)[2]


def next_capacity(capacity: int, header: Header) -> int:
    """The capacity both ends of a lane use for the frame after ``header``'s (:func:`placement`)."""
    return placement(header.meta_len, header.body_bytes, capacity)[3]


def encode_frame(header: Header, meta: bytes, items: Sequence[tuple[str, torch.Tensor]],
                 offsets: Sequence[int]) -> torch.Tensor:
    """A whole frame in one uint8 buffer: header, metadata, and the contiguous CPU ``items``
    copied into the body at ``offsets`` (:func:`flat_layout`'s)."""
    start = body_offset(len(meta), header.body_bytes)
    buf = torch.empty(start + header.body_bytes, dtype=torch.uint8)
    head = encode_header(header) + meta
    buf.numpy().data[:len(head)] = head
    for (_, t), off in zip(items, offsets, strict=True):
        if t.numel():
            b = _bytes_of(t)
            buf[start + off:start + off + b.numel()].copy_(b)
    return buf


class Placed(Protocol):
    """What :meth:`FrameBuffer.pack` reads of a frame's layout (``layouts.Layout``, which imports this module)."""

    @property
    def metas(self) -> tuple[TensorMeta, ...]: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...


class FrameBuffer:
    """A whole frame's buffer kept for the next frame of the same length (see :func:`encode_frame`:
    the same bytes, written in place). The body's destinations, typed views of each tensor's
    place, are made once per layout and metadata length, so packing a frame is one copy per
    tensor: a plain memory copy for a small real tensor (up to ``RAW_COPY_LIMIT`` bytes: a
    ``copy_`` costs a few microseconds of dispatch there, and a ``detach`` more for one that
    requires grad), else ``copy_``. The caller must not pack a buffer again before the send of its
    last frame completed."""

    __slots__ = ("buf", "view", "layout", "start", "dests")

    def __init__(self, size: int) -> None:
        self.buf = torch.empty(size, dtype=torch.uint8)
        self.view = self.buf.numpy().data
        self.layout: Placed | None = None
        self.start = -1
        self.dests: list[tuple[torch.Tensor, int, int, bool] | None] = []   # (view, address, bytes, plain)

    def pack(self, header: tuple, meta: bytes, items: Sequence[tuple[str, torch.Tensor]], layout: Placed,
             start: int) -> torch.Tensor:
        """Write ``header`` (a :class:`Header`, or its fields in a plain tuple), ``meta`` and the
        contiguous CPU ``items`` (whose metadata is ``layout``; the body at ``start``,
        :func:`body_offset`'s): the header's bytes are :func:`encode_header`'s."""
        if items and (self.layout is not layout or self.start != start):
            buf, base = self.buf, self.buf.data_ptr() + start
            self.dests = [(buf[start + off:start + off + m.nbytes].view(m.dtype).view(m.shape), base + off, m.nbytes,
                           m.nbytes <= RAW_COPY_LIMIT and not m.dtype.is_complex) if m.nbytes else None
                          for m, off in zip(layout.metas, layout.offsets, strict=True)]
            self.layout, self.start = layout, start
        flags, seq, msg, parts, n, meta_len, payload, body, key = header
        raw = _checked_key(key)
        _WHOLE.pack_into(self.view, 0, MAGIC, VERSION, flags, seq, msg, parts, n, meta_len, payload, body,
                         len(raw), raw)
        if meta:
            self.view[HEADER_BYTES:HEADER_BYTES + len(meta)] = meta
        for dst, (_, t) in zip(self.dests, items, strict=True) if items else ():
            if dst is not None:
                view, addr, nbytes, plain = dst
                # its own memory as it is: a plain CPU tensor, contiguous (the caller's contract), no
                # lazy negation (a conjugate's imaginary view), not an efficient zero tensor (no memory)
                if plain and type(t) is _Tensor and not t.is_neg() and (src := t.data_ptr()):
                    _memmove(addr, src, nbytes)
                else:
                    view.copy_(t.detach() if t.requires_grad else t)
        return self.buf


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def to_bytes_tensor(buf: bytes) -> torch.Tensor:
    """A CPU uint8 tensor holding a copy of ``buf`` (what a header or metadata op sends)."""
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def named_items(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Validate a message's tensors and return them as ``(name, tensor)`` pairs in dict order."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"a message is a dict of name -> tensor, got {type(tensors).__name__}")
    items = []
    for name, t in tensors.items():
        check_item(name, t)
        items.append((name, t))
    return items


def check_item(name: str, t: torch.Tensor) -> None:
    """Raise TypeError unless ``name`` is a string and ``t`` a dense tensor."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be strings, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"message entry {name!r} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise TypeError(f"message entry {name!r} has layout {t.layout}; only dense tensors can be sent")
