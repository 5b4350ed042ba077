"""Sizes as people write them: ``4K``, ``64M``, ``1G`` (binary units, as in the papers' plots).

The one parser of sizes (``hybridpipe bench-allreduce --sizes``, the benchmarks' ``--sizes``) and
its inverse for labels. Link rates (``1gbit``) are the emulated cluster's (``tools/emucluster``).
"""

from __future__ import annotations

import re

from hybridpipe.errors import UserError

_SIZE = re.compile(r"^(\d+)\s*([KMG]?)B?$", re.IGNORECASE)
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from ``4K``, ``64M``, ``1G`` or a plain number (binary units)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise UserError(f"cannot read size {text!r}; write it like 4K, 64M or 1048576")
    return int(m[1]) * _SCALE[m[2].upper()]


def parse_sizes(text: str, step: int = 4) -> list[int]:
    """``4K..64M`` (every size from 4 KiB up, times ``step``) or a list ``4K,1M``."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        if lo <= 0 or hi < lo or step < 2:
            raise UserError(f"size range {text!r} must go up from a positive size, with a step >= 2")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= step
        return sizes
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) <= 0:
        raise UserError(f"--sizes {text!r}: give positive sizes, e.g. 4K..64M or 4K,1M")
    return sizes


def size_label(nbytes: float) -> str:
    """``4096`` -> ``4K``; ``67108864`` -> ``64M``; else the number."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return f"{nbytes:g}"
