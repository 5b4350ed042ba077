"""The dedicated aggregator's TCP protocol (version 1), shared by server and client.

A worker connects and sends ``HELLO`` (its position and the group size); the server answers
``STATUS``. A session is the group's ``world`` workers connected at once. Each all-reduce: every
worker sends ``OP`` (sequence number, dtype, element count) and then streams its raw bytes; once
every ``OP`` has arrived and they agree, the server answers ``STATUS`` and streams the sum back,
chunk by chunk, while the workers' bytes are still coming in (cut-through). Any error: a
``STATUS`` with a message, then the session's connections close.
"""

from __future__ import annotations

import socket
import struct

import torch

from hybridpipe.errors import UserError

MAGIC = b"HPAG"
VERSION = 1
HELLO = struct.Struct("!4sHII")     # magic, version, position, world
OP = struct.Struct("!IBQ")          # sequence number, dtype code, element count
STATUS = struct.Struct("!4sBI")     # magic, 0 = ok / 1 = error, message length (message follows)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8)


class AggregatorError(RuntimeError):
    """The aggregator refused an operation or a connection of the session broke."""


class AggregatorUnreachable(AggregatorError, UserError):
    """Nobody answered at the aggregator's address, however long a worker tried: the user's
    ``--aggregator`` is wrong or its process is not running (one line, exit 2 on every rank)."""


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES.index(dtype)
    except ValueError:
        raise ValueError(f"the dedicated aggregator sums {', '.join(map(str, DTYPES))}, not {dtype}") from None


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError on end of stream.

    On a blocking socket one ``MSG_WAITALL`` call usually does it (one system call, one GIL
    hand-over, instead of one per 64 KiB segment).
    """
    got = 0
    flags = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, flags)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def recv_struct(sock: socket.socket, st: struct.Struct) -> tuple:
    buf = bytearray(st.size)
    recv_exact(sock, memoryview(buf))
    return st.unpack(buf)


def send_status(sock: socket.socket, error: str = "") -> None:
    msg = error.encode()
    sock.sendall(STATUS.pack(MAGIC, 1 if error else 0, len(msg)) + msg)


def recv_status(sock: socket.socket) -> str:
    """The error message of a STATUS ('' when ok)."""
    magic, bad, length = recv_struct(sock, STATUS)
    if magic != MAGIC:
        raise AggregatorError("the aggregator answered with a foreign protocol; is the address right?")
    msg = bytearray(length)
    recv_exact(sock, memoryview(msg))
    return msg.decode(errors="replace") if bad else ""


def set_blocking_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking mode (so MSG_WAITALL works) with kernel send/receive timeouts of ``seconds``."""
    sock.settimeout(None)
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


WAKE_BYTES = 128 << 10


def wake_after(sock: socket.socket, left: int, level: int) -> int:
    """Report the socket readable only once min(``left``, 128 KiB) bytes wait (SO_RCVLOWAT);
    returns the level set (``level``: the current one, to skip a needless system call).

    Without it a busy machine wakes an event loop for every few kilobytes that trickle in, and
    the loop spends its time in per-wake-up overhead.
    """
    want = max(1, min(left, WAKE_BYTES))
    if want != level:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
    return want


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError naming the expected form."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"aggregator address {text!r} must look like HOST:PORT, e.g. 10.0.0.254:29600")
    return host, int(port)


def byte_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    # numpy's stubs declare the buffer protocol (__buffer__) only for Python >= 3.12
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
