"""Per-link transfer orders for the ``sra`` mode (pure functions, no processes).

In ``sra`` each link (pair of ranks) is served by one thread on each side that performs the
link's transfers one after the other, in lockstep with the peer's thread: transfer i is a send
on one side and the matching receive on the other. Both sides must therefore agree on one
order per link, and that order must be consistent with what each rank's program does (a rank
cannot send something that it only computes after a receive that comes later in the order).

:func:`link_orders` derives such orders from every rank's program (its sequence of sends and
receives for one training step, as the pipeline schedule produces them) by executing the
programs with unbounded buffers and recording, per link, the order in which messages are
sent. Because every transfer of a link is placed after everything its sender received before
sending it, executing the orders in lockstep cannot deadlock (induction over the simulated
send times). The orders repeat cyclically, one cycle per training step, so each step's program
must receive every message it sends.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Mapping, Sequence

Op = tuple[str, str]                 # ("send" | "recv", key), seen from one side of a link
ProgramOp = tuple[str, int, str]     # ("send" | "recv", peer, key), one rank's program

SEND, RECV = "send", "recv"


def check_order(order: Sequence[Op], peer: int) -> list[Op]:
    """Validate one link's order and return it as a list of ``(op, key)`` tuples."""
    out = []
    for i, item in enumerate(order):
        try:
            op, key = item
        except (TypeError, ValueError):
            raise ValueError(f"sra order for peer {peer}: entry {i} is {item!r}, expected (op, key)") from None
        if op not in (SEND, RECV) or not isinstance(key, str) or not key:
            raise ValueError(f"sra order for peer {peer}: entry {i} is {item!r}; op must be "
                             f"'send' or 'recv' and key a non-empty string")
        out.append((op, key))
    return out


def mirror(order: Sequence[Op]) -> list[Op]:
    """The same order seen from the peer: every send becomes a receive and vice versa."""
    return [(RECV if op == SEND else SEND, key) for op, key in order]


def order_digest(order: Sequence[Op] | None) -> str:
    """A short stable fingerprint of an order (``"none"`` for no order)."""
    if order is None:
        return "none"
    blob = json.dumps([list(x) for x in order], separators=(",", ":")).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def keys_of(order: Sequence[Op], op: str) -> list[str]:
    """The keys of one kind of operation, in order (what the caller must send / receive)."""
    return [k for o, k in order if o == op]


def link_orders(programs: Mapping[int, Sequence[ProgramOp]]) -> dict[int, dict[int, list[Op]]]:
    """Per rank and peer, a lockstep transfer order consistent with every rank's program.

    ``programs[r]`` lists rank r's sends and receives of one step, e.g.
    ``[("send", 1, "act/0"), ("recv", 1, "grad/0")]``. Returns ``orders[r][peer]``, a list of
    ``(op, key)``; ``orders[a][b]`` is the mirror of ``orders[b][a]``. Raises ValueError when
    the programs do not match (a message received under another key, sent but never received)
    or deadlock even with unbounded buffers.
    """
    progs = {r: [_check_program_op(r, i, x) for i, x in enumerate(p)] for r, p in programs.items()}
    for r, prog in progs.items():
        for _, peer, _ in prog:
            if peer not in progs:
                raise ValueError(f"rank {r}'s program talks to rank {peer}, which has no program")
            if peer == r:
                raise ValueError(f"rank {r}'s program sends to or receives from itself")
    pc = {r: 0 for r in progs}
    queues: dict[tuple[int, int], deque[str]] = {}
    events: dict[frozenset, list[tuple[int, str]]] = {}     # link -> [(sender, key)] in send order
    progressed = True
    while progressed:
        progressed = False
        for r in sorted(progs):
            prog = progs[r]
            while pc[r] < len(prog):
                op, peer, key = prog[pc[r]]
                if op == SEND:
                    queues.setdefault((r, peer), deque()).append(key)
                    events.setdefault(frozenset((r, peer)), []).append((r, key))
                else:
                    q = queues.get((peer, r))
                    if not q:
                        break
                    if q[0] != key:
                        raise ValueError(f"rank {r} receives {key!r} from rank {peer}, but rank {peer} "
                                         f"sends {q[0]!r} next on that link")
                    q.popleft()
                pc[r] += 1
                progressed = True
    blocked = [f"rank {r} waits to receive {progs[r][pc[r]][2]!r} from rank {progs[r][pc[r]][1]}"
               for r in sorted(progs) if pc[r] < len(progs[r])]
    if blocked:
        raise ValueError("the programs deadlock even with unbounded buffers: " + "; ".join(blocked))
    left = [f"{list(q)} from rank {s} to rank {d}" for (s, d), q in sorted(queues.items()) if q]
    if left:
        raise ValueError("messages sent but never received in the step: " + "; ".join(left))
    orders: dict[int, dict[int, list[Op]]] = {r: {} for r in progs}
    for link, evs in events.items():
        a, b = sorted(link)
        orders[a][b] = [(SEND if s == a else RECV, k) for s, k in evs]
        orders[b][a] = mirror(orders[a][b])
    return orders


def _check_program_op(rank: int, i: int, item: ProgramOp) -> ProgramOp:
    try:
        op, peer, key = item
    except (TypeError, ValueError):
        raise ValueError(f"rank {rank}'s program entry {i} is {item!r}, expected (op, peer, key)") from None
    if op not in (SEND, RECV) or not isinstance(peer, int) or not isinstance(key, str):
        raise ValueError(f"rank {rank}'s program entry {i} is {item!r}; expected ('send'|'recv', int, str)")
    return op, peer, key


class Cursor:
    """Position in a cyclic sequence of keys (what the caller must send or receive next)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = list(keys)
        self._i = 0

    def peek(self) -> str | None:
        return self._keys[self._i % len(self._keys)] if self._keys else None

    def advance(self) -> None:
        self._i += 1
