"""How much compute and communication slow each other down when they overlap.

On a host with few cores, sockets, copies and reductions take CPU from the compute they are
meant to overlap, and compute takes it from them. :func:`measure_interference` measures both on
every rank of a group: a matrix multiply loop alone, ring all-reduces alone, then both at once
(the all-reduces on a thread, as the runtime's comm lanes run them). The compute lost, divided
by the bytes the rank's link carried meanwhile, is the calibration's ``interference_s_per_byte``
(charged to a stage's busy time for every byte of its transfers and syncs); the all-reduces'
time beside compute over their time alone is its ``overlap_slowdown`` (applied to every sync).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MATMUL_SIZE = 192          # small enough for a tight loop, large enough to be compute-bound


def compute_loop(stop: Callable[[], bool]) -> tuple[int, float]:
    """Matrix multiplies until ``stop()``: (count, seconds)."""
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    n, t0 = 0, time.perf_counter()
    while not stop():
        torch.mm(a, b)
        n += 1
    return n, time.perf_counter() - t0


def lost_per_byte(rate_alone: float, rate_shared: float, elapsed_s: float, traffic_bytes: float) -> float:
    """Compute seconds lost per byte: ``(1 - shared / alone) * elapsed / traffic``, never below 0."""
    if rate_alone <= 0 or traffic_bytes <= 0:
        return 0.0
    return max(0.0, 1.0 - rate_shared / rate_alone) * elapsed_s / traffic_bytes


def ring_traffic(nbytes: float, world: int) -> float:
    """Bytes one rank's link carries each way in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def measure_interference(reduce: Callable[[torch.Tensor], object], control: dist.ProcessGroup, *,
                         nbytes: int = 16 << 20, seconds: float = 1.0) -> tuple[float, float]:
    """(compute seconds lost per byte of ring all-reduce traffic, all-reduce slowdown beside compute):
    group means; every rank calls it.

    ``reduce(x)`` all-reduces ``x`` on the measured group; ``control`` is a separate group for
    barriers. All ranks compute at once in both compute phases, as in training.
    """
    world = dist.get_world_size(control)
    dist.barrier(group=control)
    end = time.perf_counter() + seconds
    n0, t0 = compute_loop(lambda: time.perf_counter() >= end)
    x = torch.ones(max(1, nbytes // 4))
    dist.barrier(group=control)
    t = time.perf_counter()
    reduce(x)
    one = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX, group=control)
    count = max(2, math.ceil(seconds / max(one.item(), 1e-6)))
    dist.barrier(group=control)
    t = time.perf_counter()
    for _ in range(count):
        reduce(x)
    alone = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(alone, op=dist.ReduceOp.MAX, group=control)
    done = threading.Event()

    def communicate() -> None:
        try:
            for _ in range(count):
                reduce(x)
        finally:
            done.set()

    dist.barrier(group=control)
    comm = threading.Thread(target=communicate, name="interference-allreduce", daemon=True)
    comm.start()
    n1, t1 = compute_loop(done.is_set)
    comm.join()
    figures = torch.tensor([lost_per_byte(n0 / t0, n1 / t1, t1, count * ring_traffic(x.numel() * 4, world)),
                            max(1.0, t1 / max(alone.item(), 1e-9))], dtype=torch.float64)
    dist.all_reduce(figures, group=control)
    lost, slowdown = (figures / world).tolist()
    return lost, slowdown
