"""What the failure guard's ranks tell each other, as plain values (failure.py drives them).

* :class:`Failure`: who failed first, why, and which rank found out (or that a signal stopped the
  job); it travels through the c10d store as JSON under ``first`` (compare-and-set: the first
  report wins). A rank that received a signal records ``sig/<rank>``.
* :func:`suspect_of`: the rank an exception points at (a p2p error names its peer).
* :func:`describe_ranks`: ``rank 3 (stage 1 replica 0)`` for messages.
* :func:`default_store`: the store they travel through (torchrun's agent store).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.distributed as dist

from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout
from hybridpipe.errors import UserError

_COLLECTIVE_MARKERS = ("connection reset", "connection closed", "read error", "write error", "broken pipe",
                       "timed out", "timeout", "socket closed", "end of file")


@dataclass(frozen=True)
class Failure:
    """Who failed first, why, and which rank found out; ``stop`` (a signal's name) when no rank
    failed but the job was stopped by that signal (``rank``: the first to report it)."""

    rank: int
    reason: str
    reporter: int
    stop: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Failure:
        return cls(**json.loads(raw.decode()))


def suspect_of(exc: BaseException) -> tuple[int | None, str]:
    """Which rank ``exc`` points at and how: ``(peer, "lost"|"stalled")`` for p2p errors,
    ``(None, "collective")`` for a failed collective that names no rank, ``(None, "own")``
    when this rank failed by itself."""
    if isinstance(exc, P2PError):
        return exc.peer, "stalled" if isinstance(exc, P2PTimeout) else "lost"
    if isinstance(exc, RuntimeError) and not isinstance(exc, UserError):
        text = str(exc).lower()
        if isinstance(exc, dist.DistError) or any(m in text for m in _COLLECTIVE_MARKERS):
            return None, "collective"
    return None, "own"


def describe_ranks(plan) -> Callable[[int], str]:
    """``rank -> "rank 3 (stage 1 replica 0)"`` for a ``hybridpipe.partitioner.plan.Plan``."""
    stages: dict[int, list[str]] = {}          # a rank of a plan with virtual stages runs several
    replica: dict[int, int] = {}
    for s in plan.stages:
        for i, r in enumerate(s.ranks):
            stages.setdefault(r, []).append(str(s.index))
            replica[r] = i

    def describe(rank: int) -> str:
        if rank not in stages:
            return f"rank {rank}"
        which = f"stage{'s' if len(stages[rank]) > 1 else ''} {','.join(stages[rank])}"
        return f"rank {rank} ({which} replica {replica[rank]})"
    return describe


def try_quietly(fn: Callable[[], object]) -> None:
    """Call ``fn``, ignoring its errors (best effort on the way out)."""
    try:
        fn()
    except Exception:           # noqa: BLE001 - best effort on the way out
        pass


def default_store() -> dist.Store:
    """The c10d store of the initialised default process group (torchrun's agent store)."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        raise RuntimeError("default_store() needs torch.distributed.init_process_group() first")
    return distributed_c10d._get_default_store()


def is_set(store: dist.Store, key: str) -> bool:
    return store.check([key])


def read_first(store: dist.Store) -> Failure | None:
    return Failure.from_bytes(store.get("first")) if is_set(store, "first") else None


def report_first(store: dist.Store, failure: Failure) -> Failure:
    # torch's stub types the value as str; the binding takes bytes as well
    return Failure.from_bytes(store.compare_set("first", "", failure.to_bytes()))  # type: ignore[arg-type]


def one_line_of(exc: BaseException) -> str:
    """``Type: first line`` of an exception, without gloo's source prefix and boilerplate."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)                # gloo's "[/path/pair.cc:553] "
    text = text.split(". This is typically caused")[0]      # and its boilerplate advice
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
