"""Which positions of a process group share a host (the inner level for hierarchical and torus2d)."""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Positions ``0..n-1`` grouped into units (hosts), each sorted, units ordered by first position."""

    units: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = sorted(p for u in self.units for p in u)
        if flat != list(range(len(flat))) or any(not u for u in self.units):
            raise ValueError(f"topology units must partition positions 0..n-1 into non-empty groups, got {self.units}")

    @property
    def size(self) -> int:
        return sum(len(u) for u in self.units)

    @property
    def uniform(self) -> int | None:
        """The common unit size, or None when units differ in size."""
        sizes = {len(u) for u in self.units}
        return sizes.pop() if len(sizes) == 1 else None

    @classmethod
    def from_labels(cls, labels: Sequence[Hashable]) -> Topology:
        """Units = positions with equal labels (e.g. hostnames), in order of first appearance."""
        units: dict[Hashable, list[int]] = {}
        for pos, label in enumerate(labels):
            units.setdefault(label, []).append(pos)
        return cls(tuple(tuple(u) for u in units.values()))

    @classmethod
    def flat(cls, n: int) -> Topology:
        """All positions on one host."""
        return cls((tuple(range(n)),))

    @classmethod
    def blocks(cls, n: int, size: int) -> Topology:
        """Consecutive blocks of ``size`` positions (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"block size must be >= 1, got {size}")
        return cls(tuple(tuple(range(s, min(s + size, n))) for s in range(0, n, size)))

    @classmethod
    def from_env(cls, global_ranks: Sequence[int]) -> Topology:
        """From torchrun's ``LOCAL_WORLD_SIZE`` (global rank r on node r // LOCAL_WORLD_SIZE);
        one host when it is unset (processes started on one machine). No communication."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if local <= 0:
            return cls.flat(len(global_ranks))
        return cls.from_labels([r // local for r in global_ranks])

    @classmethod
    def discover(cls, group: dist.ProcessGroup | None = None) -> Topology:
        """Collective over ``group``: every member's hostname, gathered."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        names: list = [None] * len(ranks)
        dist.all_gather_object(names, socket.gethostname(), group=group)
        return cls.from_labels(names)
