"""``allreduce(tensor, algorithm, group)`` and :class:`AllReducer`, the object behind it.

Every algorithm sums in place, like ``torch.distributed.all_reduce`` with ``ReduceOp.SUM``:
``ring``, ``butterfly``, ``hierarchical``, ``torus2d`` and ``aggregator`` run the schedules of
``schedule.py`` over isend/irecv (so gloo and NCCL both work); ``native`` is torch's own;
``auto`` picks the cheapest for the size and group by the partitioner's cost model, calibrated
when a calibration (``hybridpipe bench-allreduce`` output) is given. ``aggregator`` sums on the
group's first rank, or on a dedicated process (``hybridpipe aggregator``) when an address is
given (argument or ``HYBRIDPIPE_AGGREGATOR=host:port``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce import schedule
from hybridpipe.comm.allreduce.costs import AUTO_CANDIDATES, GroupCosts, group_costs
from hybridpipe.comm.allreduce.dedicated import AggregatorClient
from hybridpipe.comm.allreduce.executor import run_pipelined, run_rounds
from hybridpipe.comm.allreduce.flat import FlatSpace
from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.comm.allreduce.transport import GroupTransport
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.calibration import Calibration, load_calibration

ALGORITHMS = co.ALGORITHMS
CHOICES = ALGORITHMS + ("auto",)
AGGREGATOR_ENV = "HYBRIDPIPE_AGGREGATOR"
MIN_CHUNK_BYTES = 256 << 10          # adaptive chunks: at least this (per-message overhead) ...
MAX_CHUNK_BYTES = 2 << 20            # ... at most this, and about a quarter of a ring segment
DEFAULT_INFLIGHT = 6
ROUND_CACHE = 256                    # schedules kept per reducer (one per algorithm, variant and size)
NATIVE_FLAT_BYTES = 8 << 20          # native: several tensors up to this many bytes go as one call


class AllReducer:
    """In-place sum over one process group with any algorithm; keeps what calls can share.

    ``topology``: which positions share a host (default: the groups of ``costs`` when given,
    else from torchrun's environment, else one host). ``calibration``: a Calibration or a path to
    one, for ``auto``. ``costs``: a ready
    :class:`GroupCosts` instead (e.g. the plan's cost model and the group's global ranks).
    ``aggregator``: ``host:port`` of a dedicated aggregator. ``lane``: tags of this reducer's
    messages (collectives issued concurrently from different threads need different lanes).
    ``chunk_bytes``: the pipelined executor's chunk (default: a quarter of a ring segment, within
    256 KiB .. 2 MiB); ``inflight``: receives posted ahead. ``pipelined``: chunked, pipelined
    executor (default on CPU); False runs round by round. ``downward``: a second group of the
    same ranks for messages to lower positions (a connection per direction; butterfly and the
    aggregator exchange both ways and run at about half speed on one; see transport.py). Make it
    with :func:`downward_group` or ``dist.new_group(ranks)`` on every rank.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, topology: Topology | None = None,
                 calibration: Calibration | str | os.PathLike | None = None, costs: GroupCosts | None = None,
                 aggregator: str | None = None, lane: int = 0, chunk_bytes: int | None = None,
                 inflight: int = DEFAULT_INFLIGHT, pipelined: bool | None = None,
                 torus_shape: tuple[int, int] | None = None, downward: dist.ProcessGroup | None = None):
        self.transport = GroupTransport(group, downward)
        self.group = group
        self.size = self.transport.size
        self.position = self.transport.position
        if topology is None:
            topology = costs.topology() if costs is not None else Topology.from_env(self.transport.ranks)
        self.topology = topology
        if self.topology.size != self.size:
            raise ValueError(f"the topology describes {self.topology.size} positions but the group has {self.size}")
        if isinstance(calibration, (str, os.PathLike)):
            calibration = load_calibration(calibration)
        self.aggregator_address = aggregator or os.environ.get(AGGREGATOR_ENV) or None
        self.costs = costs or group_costs(self.topology, calibration, bool(self.aggregator_address))
        self.lane = lane
        if chunk_bytes is not None and chunk_bytes < 64 or inflight < 1:
            raise ValueError("chunk_bytes must be >= 64 and inflight >= 1")
        self.chunk_bytes = chunk_bytes
        self.inflight = inflight
        self.pipelined = pipelined
        self.torus_shape = torus_shape
        self._pools: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._described: dict[tuple, co.Collective] = {}
        self._rounds: dict[tuple, list[schedule.Round]] = {}
        self._client: AggregatorClient | None = None

    # ---- choosing --------------------------------------------------------------------------
    def choose(self, nbytes: float, candidates: Sequence[str] = AUTO_CANDIDATES) -> str:
        """What ``auto`` runs for an all-reduce of ``nbytes`` on this group."""
        if self.size <= 1 or nbytes <= 0:
            return "native"
        return self.costs.fastest(nbytes, candidates)

    def described(self, algorithm: str, nbytes: float) -> co.Collective:
        """The rounds ``algorithm`` runs here for ``nbytes``, as ``partitioner/cost/collectives.py`` writes
        them and the cost model prices them (butterfly's variant and torus2d's shape as the model
        picks them; hierarchical over this reducer's topology)."""
        key = self._variant(algorithm, nbytes)
        hit = self._described.get(key)
        if hit is None:
            hit = self._described[key] = co.rounds_for(algorithm, self.size, halving=key[1],
                                                        units=self.topology.units, shape=key[2])
        return hit

    def rounds(self, algorithm: str, numel: int, nbytes: float) -> list[schedule.Round]:
        """The schedule ``algorithm`` runs on this group for ``numel`` elements (``nbytes`` bytes):
        :meth:`described` over element ranges."""
        key = self._variant(algorithm, nbytes) + (numel,)
        hit = self._rounds.get(key)
        if hit is None:
            if len(self._rounds) >= ROUND_CACHE:
                self._rounds.clear()
            hit = self._rounds[key] = schedule.elements(self.described(algorithm, nbytes), numel)
        return hit

    def _variant(self, algorithm: str, nbytes: float) -> tuple[str, bool, tuple[int, int] | None]:
        if algorithm not in ALGORITHMS or algorithm == "native":
            raise ValueError(f"no schedule for all-reduce algorithm {algorithm!r}; "
                             f"choose from {', '.join(a for a in ALGORITHMS if a != 'native')}")
        halving = algorithm == "butterfly" and self.costs.halving(nbytes)
        shape = (self.torus_shape or self.costs.torus_shape()) if algorithm == "torus2d" else None
        return algorithm, halving, shape

    # ---- running ---------------------------------------------------------------------------
    def __call__(self, tensors: torch.Tensor | Sequence[torch.Tensor], algorithm: str = "auto") -> str:
        """Sum ``tensors`` (one tensor or several of one dtype and device) over the group in place.

        Returns the algorithm that ran (``auto`` resolved).
        """
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if algorithm not in CHOICES:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(CHOICES)}")
        items = [t for t in items if t.numel() > 0]
        if not items:
            return "native" if algorithm == "auto" else algorithm
        if len({(t.dtype, t.device) for t in items}) != 1:
            raise ValueError("tensors of one all-reduce must share dtype and device; reduce each kind separately")
        if items[0].dtype == torch.bool or items[0].is_complex():
            raise ValueError(f"all-reduce sums numbers; {items[0].dtype} is not supported")
        nbytes = sum(t.numel() for t in items) * items[0].element_size()
        if algorithm == "auto":
            algorithm = self.choose(nbytes)
        if self.size <= 1:
            return algorithm
        work = [t if t.is_contiguous() else t.contiguous() for t in items]
        if algorithm == "native":
            self._native(work, nbytes)
        elif algorithm == "aggregator" and self.aggregator_address:
            self._dedicated(work, self.aggregator_address)
        else:
            self._scheduled(work, algorithm, nbytes)
        for t, w in zip(items, work, strict=True):
            if w is not t:
                t.copy_(w)
        return algorithm

    def _native(self, tensors: list[torch.Tensor], nbytes: float) -> None:
        """The backend's own all-reduce: several tensors up to ``NATIVE_FLAT_BYTES`` in one call on a
        flat copy (a call per tensor paid gloo's whole ring latency per tensor: a Llama layer's 9
        tensors, 0.9 MB, took 40-60 ms on 4 emulated hosts where one call of their bytes is priced 15),
        larger ones tensor by tensor (their bytes dominate; no copy of them)."""
        if len(tensors) == 1 or nbytes > NATIVE_FLAT_BYTES:
            for t in tensors:
                dist.all_reduce(t, group=self.group)
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        start = 0
        for t in tensors:
            t.copy_(flat[start:start + t.numel()].view_as(t))
            start += t.numel()

    def _scheduled(self, tensors: list[torch.Tensor], algorithm: str, nbytes: float) -> None:
        staged = [t.cpu() for t in tensors] if self._needs_cpu(tensors[0]) else tensors
        itemsize = tensors[0].element_size()
        chunk = self.chunk_bytes or min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, int(nbytes) // (4 * self.size)))
        space = FlatSpace(staged, max(1, chunk // itemsize))
        rounds = self.rounds(algorithm, space.numel, nbytes)
        pipelined = self.pipelined if self.pipelined is not None else staged[0].device.type == "cpu"
        if pipelined:
            run_pipelined(rounds, space, self.transport, lane=self.lane, algorithm=algorithm,
                          inflight=self.inflight, pool=self._pool(space))
        else:
            run_rounds(rounds, space, self.transport, lane=self.lane, algorithm=algorithm)
        if staged is not tensors:
            for t, s in zip(tensors, staged, strict=True):
                t.copy_(s)

    def _needs_cpu(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" and "nccl" not in self.transport.backend

    def _pool(self, space: FlatSpace) -> list[torch.Tensor]:
        key = (space.dtype, space.device)
        pool = self._pools.get(key)
        if pool is None or pool[0].numel() < space.chunk:
            pool = self._pools[key] = [torch.empty(space.chunk, dtype=space.dtype, device=space.device)
                                       for _ in range(self.inflight)]
        return pool

    def _dedicated(self, tensors: list[torch.Tensor], address: str) -> None:
        if self._client is None:
            self._client = AggregatorClient(address, self.position, self.size)
        staged = [t.cpu() for t in tensors] if tensors[0].device.type != "cpu" else tensors
        self._client.allreduce(staged)
        if staged is not tensors:
            for t, s in zip(tensors, staged, strict=True):
                t.copy_(s)

    def close(self) -> None:
        """Drop the dedicated aggregator's connection (if any) and the buffers."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._pools.clear()


def downward_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A new gloo group with ``group``'s ranks, for :class:`AllReducer`'s ``downward``.

    A collective of the whole world (``torch.distributed.new_group``): every process calls it,
    members of ``group`` or not, in the same order as its other ``new_group`` calls.
    """
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return dist.new_group(ranks, backend=str(dist.get_backend(group)))


def allreduce(tensor: torch.Tensor, algorithm: str = "auto", group: dist.ProcessGroup | None = None, *,
              calibration: Calibration | str | os.PathLike | None = None, topology: Topology | None = None,
              aggregator: str | None = None) -> None:
    """Sum ``tensor`` over ``group`` in place with ``algorithm`` (one of :data:`CHOICES`).

    Like ``torch.distributed.all_reduce(tensor, group=group)``. For repeated calls, keep an
    :class:`AllReducer` (it holds the dedicated aggregator's connection and the buffers).
    """
    reducer = AllReducer(group, calibration=calibration, topology=topology, aggregator=aggregator)
    try:
        reducer(tensor, algorithm)
    finally:
        reducer.close()
