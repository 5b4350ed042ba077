"""What travels on a lane: a fixed-size header, optional metadata, then the payloads.

A *frame* is the unit a lane carries in FIFO order::

    header (HEADER_BYTES, uint8)  [metadata (meta_len bytes, uint8) if Flag.META]  payload_0 .. payload_{n-1}

The header names the message (its key, e.g. ``"act/3"``, and its number on this link
direction), says how many tensors the frame and the whole message carry, and how many payload
bytes follow. Metadata (names, dtypes, shapes) travels only when it differs from what was last
sent for the same *key kind* (``kind_of("act/3") == "act"``) on the same lane: both ends keep
the same cache because the lane is FIFO, so a changed shape is re-announced by the very frame
that carries it and can never be mis-received. Payloads with zero elements are not posted.

Everything here is pure (bytes in, bytes out); the threads and process groups live elsewhere.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

MAGIC = b"HPp2"
VERSION = 1
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
    """The metadata cache class of a key: the part before the first ``/`` (``"act/3"`` -> ``"act"``)."""
    return key.split("/", 1)[0]


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
