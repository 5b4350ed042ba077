"""Process groups of one job: the default group, each replicated stage's group, the p2p channels.

Every rank creates every group in the same order (``new_group`` is collective over the whole
job, members or not): first one group per replicated stage in stage order, then the pairwise
groups of the channels (``pair_groups``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import Channels, link_orders, open_channels
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.pipeline.schedules import Topology, channel_edges, transfer_program

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Process:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None, timeout_s: float) -> tuple[Process, bool]:
    """Join the job torchrun started (``env://``); without torchrun, a job of one on this host;
    or use the default process group the caller already made. Returns (process, made here).

    NCCL puts this process on ``cuda:LOCAL_RANK``; gloo on the CPU.
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return Process(dist.get_rank(), dist.get_world_size(), local_rank, backend, device), False
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--backend nccl needs a CUDA GPU, and none is visible; use --backend gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU (this host has {torch.cuda.device_count()}); "
                            "start at most one process per GPU (--nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        else:
            store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    except dist.DistNetworkError as e:
        raise UserError(store_problem(e, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                      os.environ.get("MASTER_PORT", "?"))) from None
    return Process(dist.get_rank(), dist.get_world_size(), local_rank, backend, device), True


def store_problem(e: BaseException, addr: str, port: str) -> str:
    """One line for a failure to host or reach the job's c10d store (``DistNetworkError``)."""
    text = str(e)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"port {port} on {addr} (the job's rendezvous store) is already in use by another program or job; "
                f"pick a free one with torchrun --master-port P (or --rdzv-endpoint HOST:P), or use "
                "torchrun --standalone, which picks one itself")
    first = next((x.strip() for x in text.splitlines() if x.strip()), type(e).__name__)
    return (f"cannot reach the job's rendezvous store at {addr}:{port} ({first[:200]}); check that rank 0's "
            "host is up and reachable and that every host was given the same --master-addr/--master-port "
            "(or --rdzv-endpoint)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_groups(plan: Plan, timeout_s: float) -> dict[int, dist.ProcessGroup]:
    """One process group per replicated stage (stage index -> group), made on every rank."""
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {}
    for stage in plan.stages:
        if stage.replicas > 1:
            groups[stage.index] = dist.new_group(list(stage.ranks), timeout=timeout)
    return groups


def stage_channels(topo: Topology, rank: int, schedule: Schedule, mode: str, device: torch.device, timeout_s: float,
                   on_transfer: Callable | None = None) -> Channels:
    """Open this rank's p2p channels (collective: every rank calls it with the same plan).

    In ``sra`` mode each link follows the order of one step's transfers derived from every
    rank's schedule; pipedream's messages cross step boundaries, so ``sra`` runs as ``sa`` there.
    A rank's messages to itself (between its model chunks) need no channel: the engine keeps them.
    """
    order = None
    if mode == "sra":
        programs = {r: transfer_program(topo, r, schedule) for ranks in topo.groups for r in ranks}
        fixed = {r: [op for op in p if op[1] != r] for r, p in programs.items() if p is not None}
        if len(fixed) < len(programs):
            log.info("schedule %s has no fixed per-step order: sra channels behave like sa", schedule)
        else:
            order = link_orders(fixed).get(rank, {})
    # two model chunks of one rank (virtual stages) pass their messages inside the engine
    edges = [(a, b) for a, b in channel_edges(topo) if a != b]
    return open_channels(edges, mode, device=device, timeout=timeout_s, order=order, on_transfer=on_transfer)
