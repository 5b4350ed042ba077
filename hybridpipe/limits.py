"""What this machine can hold: limits that are checked before work starts, not found by running out.

    need = events * BYTES_PER_EVENT
    require_memory(need, "simulating 10^9 steps", "simulate fewer --steps")

``available_memory_bytes()`` is the smaller of the kernel's ``MemAvailable`` and what the
process's cgroup still allows (containers, Slurm jobs). A request may use at most
``SHARE`` of it: the rest is for the interpreter, torch and everything else on the machine.

Time the other way: a search given a ``deadline`` (a ``time.monotonic()`` value) calls
``check_deadline(deadline)`` as it goes, which raises :class:`OutOfTime` once it has passed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hybridpipe.errors import UserError

SHARE = 0.8


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """Bytes the cgroup (v2, else v1) of this process may still allocate, if it is limited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":                              # v2
            base = f"/sys/fs/cgroup{parts[2]}".rstrip("/")
            limit, used = _read_int(f"{base}/memory.max"), _read_int(f"{base}/memory.current")
        elif "memory" in parts[1].split(","):                               # v1
            base = f"/sys/fs/cgroup/memory{parts[2]}".rstrip("/")
            limit, used = _read_int(f"{base}/memory.limit_in_bytes"), _read_int(f"{base}/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < 1 << 60:
            return max(limit - (used or 0), 0)
    return None


def available_memory_bytes() -> int:
    """Memory this process can still allocate (MemAvailable, bounded by its cgroup's limit)."""
    found = [x for x in (_meminfo_available(), _cgroup_room()) if x is not None]
    if not found:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(found)


def gib(n: float) -> str:
    n = min(n, 2.0 ** 1000)         # a Python int past a float's range (a count of 10**400 workers)
    return f"{n / 2 ** 30:.1f} GiB" if n < 2 ** 50 else f"{n / 2 ** 40:.3g} TiB"


def require_memory(need_bytes: float, what: str, fix: str, *, available: int | None = None) -> None:
    """UserError (one line, naming the need, the room and ``fix``) unless ``need_bytes`` fits in
    ``SHARE`` of the available memory."""
    room = available_memory_bytes() if available is None else available
    if need_bytes > SHARE * room:
        raise UserError(f"{what} needs about {gib(need_bytes)} of memory but this machine has "
                        f"{gib(room)} available; {fix}")


class OutOfTime(Exception):
    """A search's deadline passed (its caller returns the best found so far, or says so in one line)."""


def check_deadline(deadline: float | None) -> None:
    """Raise OutOfTime if ``deadline`` (``time.monotonic()``; None: none) has passed."""
    if deadline is not None and time.monotonic() > deadline:
        raise OutOfTime
