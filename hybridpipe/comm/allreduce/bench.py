"""Timing every all-reduce algorithm on a group (``hybridpipe bench-allreduce``, the benchmarks).

:func:`measure` runs on every rank of the group; rank 0 gets back the median time of the
slowest rank per (algorithm, size), one-way point-to-point times between the group's first
two ranks, gamma (seconds per byte summed locally) and, on CPU, the compute a rank loses per
byte of all-reduce traffic beside it (``interference.py``). :func:`calibrate` fits those to the
partitioner's Calibration format. Sizes, bandwidths and the table are plain functions.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce.api import AllReducer
from hybridpipe.comm.allreduce.interference import measure_interference
from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, Sample
from hybridpipe.partitioner.cost.fitting import fit_calibration
from hybridpipe.units import size_label


def busbw_gbps(nbytes: float, seconds: float, n: int) -> float:
    """NCCL-tests' bus bandwidth: algbw x 2(n-1)/n, in Gbit/s (compares with the link rate)."""
    return nbytes * 8 / seconds / 1e9 * 2 * (n - 1) / n if seconds > 0 and n > 1 else 0.0


@dataclass(frozen=True)
class BenchConfig:
    algorithms: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str = "float32"
    reps: int = 5
    max_reps: int = 50
    budget_s: float = 0.3            # aim for this much timed work per (algorithm, size)
    # every size times all algorithms side by side (rotating order), so load drift hits all alike
    aggregator: str | None = None
    chunk_bytes: int | None = None
    progress: bool = True
    device: str = "cpu"              # "cuda": CUDA tensors on an NCCL group (one GPU per rank)
    downward: bool = True            # gloo: a second group for messages to lower positions (transport.py)
    interference: bool = True        # also measure compute lost to communication (interference.py; CPU only)
    group_sizes: tuple[int, ...] = ()  # also time every algorithm on the first n ranks, for each n here (< world)


def _timed(run: Callable[[], None], control: dist.ProcessGroup) -> float:
    """One timed call, all ranks starting together; the slowest rank's time."""
    dist.barrier(group=control)
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    return t.item()


def measure_gamma(dtype: torch.dtype = torch.float32, numel: int = 1 << 22) -> float:
    """Seconds per byte of ``a += b`` on this process (the cost model's gamma)."""
    a, b = torch.ones(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / (numel * a.element_size())


def measure(rank: int, world: int, cfg: BenchConfig) -> dict | None:
    """Time every algorithm and size on the default group (every rank calls it; rank 0 gets the data), and on
    its first n ranks for each n of ``cfg.group_sizes`` (the other ranks wait; samples tagged ``ranks=n``)."""
    control = dist.new_group(backend="gloo")
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    names: list = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=control)
    sizes = sorted({n for n in cfg.group_sizes if 2 <= n < world}) + [world]
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(cfg.sizes) * len(sizes), desc="bench-allreduce", unit="size")
    samples: list[Sample] = []
    wrong: list[str] = []
    reducer = None
    for n in sizes:                           # every rank creates every group (torch requires it), in order
        members = list(range(n))
        group = dist.new_group(members, backend="nccl" if cfg.device == "cuda" else "gloo")
        down = dist.new_group(members, backend="gloo") if cfg.device != "cuda" and cfg.downward else None
        if reducer is not None:
            reducer.close()
        reducer = (AllReducer(group, topology=Topology.from_labels(names[:n]), aggregator=cfg.aggregator,
                              downward=down, chunk_bytes=cfg.chunk_bytes or None) if rank < n else None)
        samples += _time_group(rank, n, world, reducer, group, control, cfg, device, wrong, bar)
    if bar is not None:
        bar.close()
    dtype = getattr(torch, cfg.dtype)
    gamma = measure_gamma(dtype)
    interference, slowdown = 0.0, 1.0
    assert reducer is not None                # the last group is the whole world
    if cfg.device == "cpu" and cfg.interference and "ring" in cfg.algorithms:
        interference, slowdown = measure_interference(lambda t: reducer(t, "ring"), control)
    reducer.close()
    if rank != 0:
        return None
    return {"samples": samples, "world": world, "hosts": len(Topology.from_labels(names).units), "gamma": gamma,
            "wrong": wrong, "interference": interference, "overlap_slowdown": slowdown,
            "backend": "nccl" if cfg.device == "cuda" else "gloo", "device": device.type}


def _time_group(rank: int, n: int, world: int, reducer: AllReducer | None, group: dist.ProcessGroup,
                control: dist.ProcessGroup, cfg: BenchConfig, device: torch.device, wrong: list[str],
                bar) -> list[Sample]:
    """Every algorithm (and p2p, on the whole world) at every size on the first ``n`` ranks; the others take part
    in the timing's barriers only. Wrong sums are appended to ``wrong``."""
    dtype = getattr(torch, cfg.dtype)
    cases = list(cfg.algorithms) + (["p2p"] if n == world > 1 else [])
    samples = []

    def run(x: torch.Tensor, case: str) -> None:
        if reducer is None:                   # not in the group timed
            return
        if case == "p2p":
            _ping_pong(x, rank, group)
        else:
            reducer(x, case)

    for nbytes in cfg.sizes:
        numel = max(1, nbytes // dtype.itemsize)
        x = torch.full((numel,), float(rank + 1), dtype=dtype, device=device)
        first = {}
        for case in cases:                  # warm-up (buffers, connections), check, size the reps
            x.fill_(rank + 1)
            first[case] = _timed(functools.partial(run, x, case), control)
            if case != "p2p" and reducer is not None and not bool((x == n * (n + 1) // 2).all()):
                wrong.append(f"{case} at {size_label(nbytes)}" + (f" on {n} ranks" if n < world else ""))
        reps = int(min(cfg.max_reps, max(cfg.reps, cfg.budget_s * len(cases) / max(sum(first.values()), 1e-6))))
        times: dict[str, list[float]] = {case: [] for case in cases}
        for rep in range(reps):             # side by side: every case in each repetition, rotating
            shift = rep % len(cases)
            for case in cases[shift:] + cases[:shift]:
                times[case].append(_timed(functools.partial(run, x, case), control))
        for case in cases:
            seconds = statistics.median(times[case]) / (2 if case == "p2p" else 1)   # p2p: a round trip
            samples.append(Sample(case, numel * dtype.itemsize, seconds, 0 if n == world else n))
        if bar is not None:
            bar.update(1)
    return samples


def _ping_pong(x: torch.Tensor, rank: int, group: dist.ProcessGroup) -> None:
    """Group ranks 0 and 1 bounce ``x`` once; the others idle."""
    if rank == 0:
        dist.send(x, 1, group=group)
        dist.recv(x, 1, group=group)
    elif rank == 1:
        dist.recv(x, 0, group=group)
        dist.send(x, 0, group=group)


def calibrate(result: dict, level: str = "", notes: Sequence[str] = ()) -> Calibration:
    """The Calibration (alpha, beta per algorithm) of :func:`measure`'s rank-0 result."""
    if result["world"] < 2:
        raise UserError("an all-reduce calibration needs at least 2 ranks; pass --ranks 2 or more")
    return fit_calibration(result["samples"], world_size=result["world"], hosts=result["hosts"],
                           backend=result["backend"], device=result["device"], gamma_s_per_byte=result["gamma"],
                           level=level, created=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                           notes=tuple(notes), interference_s_per_byte=result.get("interference", 0.0),
                           overlap_slowdown=result.get("overlap_slowdown", 1.0))


def calibrate_group(algorithms: Sequence[str], sizes: Sequence[int], *, reps: int = 3, budget_s: float = 0.1,
                    level: str = "", notes: Sequence[str] = ()) -> Calibration:
    """Measure and fit on the default group, inside a running job: every rank calls it and every
    rank gets the same Calibration (rank 0 fits, then broadcasts it).

    For benchmarks and jobs that price ``auto`` or the hybrid policy from measurements of the
    very cluster they run on, without a separate ``hybridpipe bench-allreduce`` run.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = BenchConfig(tuple(algorithms), tuple(sizes), reps=reps, max_reps=max(reps, 20), budget_s=budget_s,
                      progress=False, interference=False)
    result = measure(rank, world, cfg)
    box: list = [None]
    if result is not None:                  # rank 0
        if result["wrong"]:
            box[0] = f"wrong sums from {', '.join(result['wrong'])}"
        else:
            box[0] = calibrate(result, level, notes)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(f"calibration failed: {box[0]}; this is a bug, please report it")
    return box[0]


def fits_summary(cal: Calibration) -> dict[str, dict[str, float]]:
    """Per fitted algorithm (and p2p): alpha in microseconds, 1/beta in Gbit/s, median error."""
    out = {}
    for name, fit in sorted(cal.algorithms.items()) + [("p2p", cal.p2p)]:
        out[name] = {"alpha_us": fit.alpha_s * 1e6,
                     "gbps": 8e-9 / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else float("inf"),
                     "rel_error": fit.rel_error}
    return out


def table(samples: Sequence[Sample], world: int) -> str:
    """Latency and bus bandwidth per size (rows) and algorithm (columns); * marks the fastest."""
    algos = list(dict.fromkeys(s.algorithm for s in samples if s.algorithm != "p2p"))
    sizes = sorted({s.bytes for s in samples})
    at = {(s.algorithm, s.bytes): s.seconds for s in samples}
    head = f"{'size':>6} " + "".join(f"{a:>22}" for a in algos) + (f"{'p2p one-way':>14}" if ("p2p", sizes[0]) in at
                                                                  else "")
    lines = [head, f"{'':>6} " + "".join(f"{'ms    busbw Gbit/s':>22}" for _ in algos)]
    for size in sizes:
        row = {a: at[(a, size)] for a in algos if (a, size) in at}
        best = min(row, key=row.__getitem__) if row else None
        cells = "".join(f"{'-':>22}" if a not in row else
                        f"{row[a] * 1e3:>10.3f} {busbw_gbps(size, row[a], world):>9.2f}{'*' if a == best else ' '}"
                        for a in algos)
        p2p = f"{at[('p2p', size)] * 1e3:>11.3f} ms" if ("p2p", size) in at else ""
        lines.append(f"{size_label(size):>6} {cells}{p2p}")
    return "\n".join(lines)
