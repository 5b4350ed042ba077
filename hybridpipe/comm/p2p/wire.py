"""What travels on a lane: a fixed-size header, optional metadata, then the payloads.

A *frame* is the unit a lane carries in FIFO order::

    header (HEADER_BYTES, uint8)  [metadata (meta_len bytes, uint8) if Flag.META]  payload_0 .. payload_{n-1}

The header names the message (its key, e.g. ``"act/3"``, and its number on this link
direction), says how many tensors the frame and the whole message carry, and how many payload
bytes follow. Metadata (names, dtypes, shapes) travels only when it differs from what was last
sent for the same *key kind* (``kind_of("act/0/3") == "act/0"``) on the same lane: both ends keep
the same cache because the lane is FIFO, so a changed shape is re-announced by the very frame
that carries it and can never be mis-received. Payloads with zero elements are not posted.

On CPU lanes (gloo) a frame's tensors travel as one *flat* message (:func:`flat_layout`: each
tensor's bytes at a 64-byte aligned offset; a single tensor is sent from its own memory, several
are packed). The receiver keeps that message's receive posted before the header arrives, into a
buffer of the lane's *capacity* (the largest flat message so far; gloo accepts a shorter message
into a larger buffer), so header and payload move at once instead of one after the other. Both
ends derive the capacity from the frames already on the lane (it stays 0 on ``sra`` lanes, which
receive in order only); a frame that does not fit (or a
CLOSE) first satisfies the posted receive with a one-byte filler, then sends its payload alone.

Everything here is pure (bytes in, bytes out); the threads and process groups live elsewhere.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

MAGIC = b"HPp2"
VERSION = 2
HEADER_BYTES = 128
# magic, version, flags, frame seq, message number, tensors in message, tensors in frame,
# metadata length, payload bytes, key length
_FIXED = struct.Struct("<4sHHQQIIIQH")
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size


class WireError(ValueError):
    """Malformed or inconsistent bytes on a lane (the channel turns it into ProtocolError)."""


class Flag(enum.IntFlag):
    NONE = 0
    META = 1    # metadata follows the header and replaces the cached one for this key kind
    CLOSE = 2   # the sender closed its channels; nothing follows on this lane
    HELLO = 4   # first frame of a lane: the key carries the sender's configuration


@dataclass(frozen=True)
class Header:
    flags: Flag
    seq: int            # frame number on this lane, from 0
    msg: int            # message number on this link direction, from 0
    parts: int          # tensors in the whole message (all lanes)
    n_tensors: int      # tensors carried by this frame
    meta_len: int       # bytes of metadata following the header (0 unless Flag.META)
    payload_bytes: int  # total payload bytes of this frame (cross-checked with the metadata)
    key: str


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kind_of(key: str) -> str:
    """The metadata cache class of a key: the part before the last ``/`` (``"act/3"`` -> ``"act"``,
    ``"act/2/3"`` -> ``"act/2"``: the pipeline's keys name the producing stage, so two model chunks
    sharing a link keep a cache each)."""
    return key.rsplit("/", 1)[0]


def check_key(key: str) -> bytes:
    """Encode ``key`` for a header; raise ValueError if it cannot be carried."""
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
                        h.meta_len, h.payload_bytes, len(raw))
    return (fixed + raw).ljust(HEADER_BYTES, b"\0")


def decode_header(buf: bytes) -> Header:
    """Parse a header; raise WireError if the bytes are not one."""
    if len(buf) != HEADER_BYTES:
        raise WireError(f"header has {len(buf)} bytes, expected {HEADER_BYTES}")
    magic, version, flags, seq, msg, parts, n, meta_len, payload, key_len = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: the peer is not speaking the hybridpipe p2p protocol "
                        "(or frames are misaligned)")
    if version != VERSION:
        raise WireError(f"peer speaks p2p protocol version {version}, this side {VERSION}; "
                        "run the same hybridpipe version on every rank")
    if key_len > MAX_KEY_BYTES:
        raise WireError(f"key length {key_len} exceeds {MAX_KEY_BYTES}")
    key = bytes(buf[_FIXED.size:_FIXED.size + key_len]).decode("utf-8", errors="replace")
    return Header(Flag(flags), seq, msg, parts, n, meta_len, payload, key)


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


FLAT_ALIGN = 64


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
    full = [(t, off) for (_, t), off in zip(items, offsets, strict=True) if t.numel()]
    if len(full) == 1:
        return _bytes_of(full[0][0])
    flat = torch.empty(total, dtype=torch.uint8)
    for t, off in full:
        b = _bytes_of(t)
        flat[off:off + b.numel()].copy_(b)
    return flat


def unflatten(flat: torch.Tensor | None, metas: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
    """Named tensors viewing a received flat message (no copies; they share its storage)."""
    offsets, _ = flat_layout(metas)
    out = {}
    for m, off in zip(metas, offsets, strict=True):
        if m.nbytes == 0:
            out[m.name] = torch.empty(m.shape, dtype=m.dtype)
        elif flat is None:
            raise WireError(f"tensor {m.name!r} has {m.nbytes} bytes but the message has none")
        else:
            out[m.name] = flat[off:off + m.nbytes].view(m.dtype).view(m.shape)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def to_bytes_tensor(buf: bytes) -> torch.Tensor:
    """A CPU uint8 tensor holding a copy of ``buf`` (what a header or metadata op sends)."""
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def from_bytes_tensor(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


class MetaCache:
    """Last metadata per key kind on one lane direction (kept identical on both ends)."""

    def __init__(self) -> None:
        self._by_kind: dict[str, tuple[TensorMeta, ...]] = {}

    def changed(self, key: str, metas: tuple[TensorMeta, ...]) -> bool:
        """True (and remember ``metas``) if they differ from the cached ones for ``key``'s kind."""
        kind = kind_of(key)
        if self._by_kind.get(kind) == metas:
            return False
        self._by_kind[kind] = metas
        return True

    def update(self, key: str, metas: tuple[TensorMeta, ...]) -> None:
        self._by_kind[kind_of(key)] = metas

    def get(self, key: str) -> tuple[TensorMeta, ...] | None:
        return self._by_kind.get(kind_of(key))


def named_items(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Validate a message's tensors and return them as ``(name, tensor)`` pairs in dict order."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"a message is a dict of name -> tensor, got {type(tensors).__name__}")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"message entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(f"message entry {name!r} has layout {t.layout}; only dense tensors can be sent")
        items.append((name, t))
    return items
