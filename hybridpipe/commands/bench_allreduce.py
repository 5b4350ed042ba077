"""``hybridpipe bench-allreduce``: time every all-reduce algorithm, write a calibration.

Locally it spawns ``--ranks`` processes on this machine (gloo); under torchrun (``RANK`` and
``WORLD_SIZE`` set) every process joins and rank 0 writes the results, so the same command
calibrates a multi-host cluster:

    hybridpipe bench-allreduce --ranks 4 --sizes 4K..64M -o allreduce.json
    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m hybridpipe.cli bench-allreduce --level network -o allreduce.json

Writes the calibration (the partitioner's format: alpha/beta per algorithm, p2p, gamma, the raw
samples), a PNG of bus bandwidth against size, and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

from hybridpipe.argtypes import float_range, int_range, output_file, positive_float
from hybridpipe.comm.allreduce.api import ALGORITHMS
from hybridpipe.comm.allreduce.bench import BenchConfig, busbw_gbps, calibrate, measure, table
from hybridpipe.errors import UserError
from hybridpipe.units import parse_sizes, size_label

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", type=output_file, required=True, help="calibration JSON to write")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma-separated, from {','.join(ALGORITHMS)} (default: all)")
    p.add_argument("--sizes", default="4K..64M",
                   help="message sizes: a range 4K..64M or a list 4K,1M (default 4K..64M)")
    p.add_argument("--size-step", type=int_range(2), default=4, help="factor between sizes of a range (default 4)")
    p.add_argument("--group-sizes", default="none", type=group_sizes,
                   help="also time every algorithm on the first N ranks for each N, so groups of fewer ranks than "
                   "the whole are priced from their own fit: none (default), auto (2, 4, 8, ... below the ranks) "
                   "or a list 2,3,6")
    p.add_argument("--ranks", type=int_range(2, 1024), default=4,
                   help="local processes to spawn when not under torchrun (default 4)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "int64"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: CUDA tensors on NCCL, one GPU per rank (under torchrun)")
    p.add_argument("--reps", type=int_range(1, 100_000), default=5,
                   help="minimum timed repetitions per case (default 5)")
    p.add_argument("--budget", type=float_range(0.0, 3600.0), default=0.3,
                   help="seconds of timed repetitions per case (default 0.3)")
    p.add_argument("--level", type=level_name, default=None,
                   help="the cluster level the ranks span (a name in your cluster file)")
    p.add_argument("--aggregator", default=None, help="HOST:PORT of a dedicated aggregator (hybridpipe aggregator)")
    p.add_argument("--png", type=output_file, default=None,
                   help="figure of busbw against size (default: OUTPUT with .png)")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds before local ranks are stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def level_name(text: str) -> str:
    """An argparse type: a cluster level's name as cluster files spell them (e.g. node, network)."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", text):
        raise argparse.ArgumentTypeError(f"must be the name of a level in your cluster file (letters, digits, "
                                         f"_ . -; e.g. network), got {text!r}")
    return text


def group_sizes(text: str) -> tuple[int, ...] | None:
    """An argparse type: ``auto`` (None: powers of two below the world), ``none`` (()) or a list of sizes >= 2."""
    if text == "auto":
        return None
    if text == "none":
        return ()
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError(f"must be auto, none or a list of group sizes >= 2 like 2,4, got {text!r}")
    return sizes


def powers_of_two_below(world: int) -> tuple[int, ...]:
    """2, 4, 8, ... below ``world``: the sizes ``--group-sizes auto`` times besides the whole group."""
    return tuple(1 << k for k in range(1, max(world - 1, 1).bit_length()) if 1 << k < world)


def _config(args: argparse.Namespace, world: int) -> BenchConfig:
    algorithms = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise UserError(f"--algorithms: unknown {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(ALGORITHMS)}")
    sizes = parse_sizes(args.sizes, args.size_step)
    if len(sizes) < 2:
        raise UserError("--sizes: give at least two sizes (alpha and beta are fitted from them)")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device here; measure on a GPU machine or use --device cpu")
    groups = powers_of_two_below(world) if args.group_sizes is None else args.group_sizes
    too_big = [n for n in groups if n >= world]
    if too_big:
        raise UserError(f"--group-sizes {','.join(map(str, too_big))}: a group must have fewer ranks than the "
                        f"{world} measured (the whole group is always timed)")
    return BenchConfig(algorithms, tuple(sizes), args.dtype, args.reps, max(args.reps, 50), args.budget,
                       args.aggregator, progress=not args.no_progress, device=args.device, group_sizes=groups)


def run(args: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    cfg = _config(args, int(os.environ["WORLD_SIZE"]) if torchrun else args.ranks)
    if torchrun:
        import torch.distributed as dist
        dist.init_process_group("gloo")              # the measured group gets its own backend
        try:
            result = measure(dist.get_rank(), dist.get_world_size(), cfg)
        finally:
            dist.destroy_process_group()
        if result is None:
            return 0
    else:
        if cfg.device == "cuda":
            import torch
            if torch.cuda.device_count() < args.ranks:
                raise UserError(f"--device cuda needs a GPU per rank: {args.ranks} ranks, "
                                f"{torch.cuda.device_count()} GPU(s); lower --ranks")
        from hybridpipe.comm.local import describe_failures, run_local
        log.info("timing %s at %d sizes on %d local ranks", ",".join(cfg.algorithms), len(cfg.sizes), args.ranks)
        outcomes = run_local(measure, args.ranks, cfg, timeout_s=args.timeout)
        problems = describe_failures(outcomes)
        if problems:
            raise UserError(f"the benchmark ranks failed:\n{problems}")
        result = outcomes[0].value
    if result["wrong"]:
        raise UserError(f"wrong sums from {', '.join(result['wrong'])}: this is a bug, please report it")
    notes = [f"dtype {cfg.dtype}", f"{result['world']} ranks on {result['hosts']} host(s)"]
    if cfg.group_sizes:
        notes.append(f"also timed on the first {', '.join(map(str, cfg.group_sizes))} ranks (group_fits)")
    if cfg.aggregator:
        notes.append(f"aggregator measured on a dedicated process at {cfg.aggregator}")
    cal = calibrate(result, args.level or "", notes)
    from hybridpipe.partitioner.cost.calibration import save_calibration
    out = save_calibration(cal, args.output)
    print(table([s for s in cal.samples if not s.ranks], cal.world_size))
    print()
    for name, fit in sorted(cal.algorithms.items()) + [("p2p", cal.p2p)]:
        gbps = 8e-9 / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else float("inf")
        print(f"{name:>12}: alpha {fit.alpha_s * 1e6:9.1f} us  1/beta {gbps:8.2f} Gbit/s  "
              f"median error {fit.rel_error * 100:5.1f} %")
    for n, fits in sorted(cal.group_fits.items()):
        print(f"on the first {n} ranks: " + ", ".join(
            f"{name} {fit.alpha_s * 1e6:.0f} us + {8e-9 / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else 0:.2f}"
            " Gbit/s" for name, fit in sorted(fits.items())))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    _plot(cal, png)
    if cal.interference_s_per_byte:
        print(f"compute lost to communication: {cal.interference_s_per_byte * 1e9:.3f} ms per MB of link traffic; "
              f"an all-reduce beside compute takes {cal.overlap_slowdown:.2f}x its time alone "
              "(interference_s_per_byte, overlap_slowdown: charged by the partitioner)")
    print(f"\nwrote {out} and {png}")
    return 0


def _plot(cal, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in dict.fromkeys(s.algorithm for s in cal.samples if s.algorithm != "p2p"):
        pts = sorted((s.bytes, busbw_gbps(s.bytes, s.seconds, cal.world_size)) for s in cal.samples
                     if s.algorithm == name and not s.ranks)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    sizes = sorted({s.bytes for s in cal.samples})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes], rotation=45, fontsize=7)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (Gbit/s)")
    ax.set_title(f"all-reduce, {cal.world_size} ranks on {cal.hosts} host(s), {cal.backend}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
