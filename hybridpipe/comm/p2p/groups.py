"""Pairwise process groups for point-to-point channels, created collectively.

Each edge {a, b} of the stage graph gets its own process groups, one per direction and lane
(``lanes`` > 1 only for the ``per-tensor`` mode, which has a thread per tensor), so that
concurrent traffic with different peers, or in the two directions of one link, never shares
a communicator: on gloo one group's ops to a peer match in posting order; on NCCL one
communicator's kernels run on one stream, so two threads sharing it could deadlock.

Headers and metadata always go over gloo (CPU) groups, which honour per-operation timeouts
and report a dead peer as a closed connection; on CUDA the payloads go over NCCL groups of
the same pairs. A process's gloo pair groups share one gloo device, so one event-loop thread
(the default group's when it runs gloo; see shared_gloo.py).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p.shared_gloo import gloo_pair_group, shared_gloo_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """The groups carrying one direction of one lane between two ranks."""

    src: int
    dst: int
    lane: int
    control: dist.ProcessGroup   # gloo: headers and metadata
    data: dist.ProcessGroup      # payloads (the same group on CPU, NCCL on CUDA)


@dataclass(frozen=True)
class PairGroups:
    """This rank's routes to its peers (see :func:`pair_groups`)."""

    rank: int
    device: torch.device
    lanes: int
    edges: tuple[tuple[int, int], ...]
    routes: Mapping[tuple[int, int, int], Route]   # (src, dst, lane) with src or dst == rank

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({b if a == self.rank else a for a, b in self.edges if self.rank in (a, b)}))

    def outbound(self, peer: int, lane: int = 0) -> Route:
        return self.routes[(self.rank, peer, lane)]

    def inbound(self, peer: int, lane: int = 0) -> Route:
        return self.routes[(peer, self.rank, lane)]


def normalize_edges(edges: Iterable[tuple[int, int]], world_size: int) -> tuple[tuple[int, int], ...]:
    """Undirected, deduplicated, sorted edges; ValueError for self-loops or unknown ranks."""
    out = set()
    for e in edges:
        try:
            a, b = (int(x) for x in e)
        except (TypeError, ValueError):
            raise ValueError(f"an edge is a pair of ranks, got {e!r}") from None
        if a == b:
            raise ValueError(f"edge {e!r} connects rank {a} to itself")
        if not (0 <= a < world_size and 0 <= b < world_size):
            raise ValueError(f"edge {e!r} names a rank outside 0..{world_size - 1}")
        out.add((min(a, b), max(a, b)))
    return tuple(sorted(out))


def pair_groups(edges: Iterable[tuple[int, int]], *, lanes: int = 1, device: str | torch.device = "cpu",
                timeout_s: float = 1800.0) -> PairGroups:
    """Create the point-to-point groups for ``edges``. Collective: every rank of the default
    group must call it with the same edges, lanes and device (checked; ValueError otherwise).

    ``device`` is the device of the tensors the channels will carry (``cuda`` means the current
    device: call ``torch.cuda.set_device`` first); for ``cuda`` the payload groups use NCCL.
    ``timeout_s`` is the groups' own backend timeout (channels pass explicit, usually shorter,
    timeouts to every wait).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"channels carry cpu or cuda tensors, not {device.type}")
    if device.type == "cuda" and device.index is None:     # comm threads must not fall back to cuda:0
        device = torch.device("cuda", torch.cuda.current_device())
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    rank, world = dist.get_rank(), dist.get_world_size()
    norm = normalize_edges(edges, world)
    _check_same_everywhere((norm, lanes, device.type))     # the index may differ between ranks
    timeout = datetime.timedelta(seconds=timeout_s)
    shared = shared_gloo_options()          # one gloo device (one event-loop thread) for them all
    routes: dict[tuple[int, int, int], Route] = {}
    for a, b in norm:
        for src, dst in ((a, b), (b, a)):
            for lane in range(lanes):
                # every rank creates every group, in the same order (new_group is collective)
                control = (gloo_pair_group([a, b], timeout, shared) if shared is not None
                           else dist.new_group([a, b], timeout=timeout, backend="gloo"))
                data = (dist.new_group([a, b], timeout=timeout, backend="nccl")
                        if device.type == "cuda" else control)
                if rank in (a, b):
                    routes[(src, dst, lane)] = Route(src, dst, lane, control, data)
    log.debug("rank %d: %d p2p routes over %d edges, %d lane(s)", rank, len(routes), len(norm), lanes)
    return PairGroups(rank, device, lanes, norm, routes)


def _check_same_everywhere(config: tuple) -> None:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, config)
    for r, other in enumerate(gathered):
        if other != config:
            raise ValueError(f"pair_groups was called with different arguments on rank {r} "
                             f"({other}) and rank {dist.get_rank()} ({config}); every rank must pass "
                             "the same edges, lanes and device")
