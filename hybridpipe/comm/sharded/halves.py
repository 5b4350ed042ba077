"""Running a reduce-scatter or an all-gather from its description, over one group's transport.

``partitioner/cost/collectives.py`` writes each sharding algorithm once (:func:`~collectives.halves`:
the two halves of its all-reduce) and finds which parts each position owns after the
reduce-scatter (:func:`~collectives.owners`); here the same rounds run over element ranges with the
all-reduce executors (chunked and pipelined on the CPU, round by round elsewhere), in place on a
list of tensors seen as one flat vector (a sync unit's gradients or weights, no fusion buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridpipe.comm.allreduce.executor import run_pipelined, run_rounds
from hybridpipe.comm.allreduce.flat import FlatSpace
from hybridpipe.comm.allreduce.schedule import Round, elements
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost import shard_halves as sh

MIN_CHUNK_BYTES = 256 << 10
MAX_CHUNK_BYTES = 2 << 20
INFLIGHT = 6


@dataclass(frozen=True)
class Halves:
    """One algorithm's two halves on ``numel`` elements, and each position's owned elements."""

    algorithm: str
    reduce_scatter: tuple[Round, ...]
    all_gather: tuple[Round, ...]
    owned: tuple[tuple[int, int], ...]     # per position: elements [lo, hi) it owns


def plan_halves(algorithm: str, n: int, numel: int, *, units: Sequence[Sequence[int]] | None = None,
                shape: tuple[int, int] | None = None) -> Halves:
    """The halves the plan's ``algorithm`` runs for a unit of ``numel`` elements on ``n`` positions
    (``collectives.shard_algorithm`` maps algorithms without halves to the ring)."""
    name = sh.shard_algorithm(algorithm, n, units)
    rs, ag = sh.halves(name, n, units=units, shape=shape if name == "torus2d" else None)
    parts = sh.owners(rs, n)
    owned = tuple(tuple(co.element_bounds(np.asarray(p), rs.parts, numel).tolist()) for p in parts)
    return Halves(name, tuple(elements(rs, numel)), tuple(elements(ag, numel)), owned)


class HalvesRunner:
    """Runs :class:`Halves` over ``transport`` (position, size, backend, isend/irecv: GroupTransport
    or the in-process one) on message lane ``lane``."""

    def __init__(self, transport: Any, lane: int):
        self.transport, self.lane = transport, lane
        self._pools: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def run(self, rounds: Sequence[Round], tensors: Sequence[torch.Tensor], algorithm: str) -> None:
        """Execute this position's share of ``rounds`` in place on ``tensors`` (one dtype, contiguous)."""
        if self.transport.size <= 1 or not rounds:
            return
        itemsize = tensors[0].element_size()
        nbytes = sum(t.numel() for t in tensors) * itemsize
        chunk = min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, nbytes // (4 * self.transport.size)))
        staged = [t.cpu() for t in tensors] if self._needs_cpu(tensors[0]) else list(tensors)
        space = FlatSpace(staged, max(1, chunk // itemsize))
        if staged[0].device.type == "cpu":
            run_pipelined(rounds, space, self.transport, lane=self.lane, algorithm=algorithm, inflight=INFLIGHT,
                          pool=self._pool(space))
        else:
            run_rounds(rounds, space, self.transport, lane=self.lane, algorithm=algorithm)
        for t, s in zip(tensors, staged, strict=True):
            if s is not t:
                t.copy_(s)

    def _needs_cpu(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" and "nccl" not in str(getattr(self.transport, "backend", ""))

    def _pool(self, space: FlatSpace) -> list[torch.Tensor]:
        key = (space.dtype, space.device)
        pool = self._pools.get(key)
        if pool is None or pool[0].numel() < space.chunk:
            pool = self._pools[key] = [torch.empty(space.chunk, dtype=space.dtype, device=space.device)
                                       for _ in range(INFLIGHT)]
        return pool
