"""Failures of point-to-point channels.

Every error names the peer rank and what was being awaited, so that a stage that dies
ends the others with one line that points at the culprit. They derive from
:class:`hybridpipe.errors.UserError` (a peer that died or stalled is a run problem, not a
bug in hybridpipe) so the CLI and launch.py print them on one line and exit non-zero.
"""

from __future__ import annotations

import re

from hybridpipe.errors import UserError


class P2PError(UserError):
    """A channel to ``peer`` failed while awaiting ``what`` (e.g. ``"recv 'act/3'"``)."""

    def __init__(self, peer: int, what: str, detail: str) -> None:
        self.peer = peer
        self.what = what
        self.detail = detail
        super().__init__(f"{self.summary}: rank {peer}, awaiting {what}: {detail}")

    summary = "p2p channel failed"

    def __reduce__(self):  # keep the fields when pickled across processes
        return (type(self), (self.peer, self.what, self.detail))


class P2PTimeout(P2PError, TimeoutError):
    """Nothing arrived from (or was accepted by) the peer within the timeout."""

    summary = "p2p timeout"


class PeerLost(P2PError, ConnectionError):
    """The peer's process is gone (connection closed or reset) or it closed its channels."""

    summary = "p2p peer lost"


class ProtocolError(P2PError):
    """Both sides disagree: wrong key, mode, order, sequence number or metadata."""

    summary = "p2p protocol error"


_LOST_MARKERS = (
    "connection closed", "connection reset", "broken pipe", "socket closed",
    "closed by peer", "connection refused", "end of file",
)
_TIMEOUT_MARKERS = ("timed out", "timeout")


def classify_transport_error(exc: BaseException, peer: int, what: str) -> P2PError:
    """Turn a backend (gloo / NCCL) exception into the matching :class:`P2PError`.

    A timeout reported by the backend becomes :class:`P2PTimeout`; anything else leaves the
    link unusable and becomes :class:`PeerLost` (a closed or reset connection is the usual
    cause: the peer's process exited).
    """
    if isinstance(exc, P2PError):
        return exc
    text = _first_sentence(str(exc)) or type(exc).__name__
    low = text.lower()
    if any(m in low for m in _TIMEOUT_MARKERS):
        return P2PTimeout(peer, what, f"backend timeout ({text})")
    if any(m in low for m in _LOST_MARKERS):
        return PeerLost(peer, what, f"connection lost, the peer's process probably exited ({text})")
    return PeerLost(peer, what, f"transport error {type(exc).__name__}: {text}")


def _first_sentence(text: str) -> str:
    """The backend's message without its source location and boilerplate advice."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)          # "[/path/pair.cc:553] "
    head, dot, _ = line.partition(". ")
    return head + dot.strip()
