"""Several tensors seen as one flat vector, without copying them.

The all-reduce schedules address a flat range ``[0, numel)``; a :class:`FlatSpace` maps a range
to pieces of the member tensors, cut at tensor boundaries and at a fixed chunk grid, so that a
layer's weight and bias are summed in place (no fusion buffer) and both ends of a message cut it
the same way (the grid depends only on the shapes, which all ranks share).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of the flat vector; they lie in one tensor and one grid cell."""

    lo: int
    hi: int
    cell: int


class FlatSpace:
    """Contiguous tensors of one dtype and device laid end to end (each viewed as 1-D)."""

    def __init__(self, tensors: Sequence[torch.Tensor], chunk_elems: int):
        if not tensors:
            raise ValueError("a flat space needs at least one tensor")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
        first = tensors[0]
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"tensors of one all-reduce must share dtype and device; got {first.dtype} on "
                                 f"{first.device} and {t.dtype} on {t.device}")
            if not t.is_contiguous():
                raise ValueError("FlatSpace needs contiguous tensors")
        self.views = [t.view(-1) for t in tensors]
        self.starts = [0]
        for v in self.views:
            self.starts.append(self.starts[-1] + v.numel())
        self.numel = self.starts[-1]
        self.chunk = chunk_elems
        self.dtype = first.dtype
        self.device = first.device

    def pieces(self, lo: int, hi: int) -> Iterator[Piece]:
        """``[lo, hi)`` cut at tensor boundaries and at multiples of the chunk size."""
        x = lo
        while x < hi:
            t = bisect.bisect_right(self.starts, x) - 1
            end = min(hi, self.starts[t + 1], (x // self.chunk + 1) * self.chunk)
            yield Piece(x, end, x // self.chunk)
            x = end

    def view(self, lo: int, hi: int) -> torch.Tensor:
        """The elements ``[lo, hi)`` (which must lie inside one tensor) as a 1-D view."""
        t = bisect.bisect_right(self.starts, lo) - 1
        base = self.starts[t]
        if hi > self.starts[t + 1]:
            raise ValueError(f"range [{lo}, {hi}) crosses a tensor boundary at {self.starts[t + 1]}")
        return self.views[t][lo - base:hi - base]
