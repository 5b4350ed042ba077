"""Every all-reduce algorithm against torch's own (gloo), 4 KB .. 16 MB, on 4 local processes.

All algorithms are timed side by side: for every size, repetitions cycle through the algorithms
(rotating the order), so machine load drifts over all of them alike; each timing is the slowest
rank's, all ranks starting together after a barrier. Reported: median latency, busbw, and the
ratio to native of the same size. ``aggregator-dedicated`` runs the aggregator as its own
process (``hybridpipe aggregator``) on this machine. Every result is checked against the exact sum.

    .venv/bin/python benchmarks/allreduce_loopback.py            # 4 ranks, 4K..16M
    .venv/bin/python benchmarks/allreduce_loopback.py --quick    # fewer repetitions
    .venv/bin/hybridpipe bench-allreduce --ranks 4 -o cal.json    # then auto by measurement:
    .venv/bin/python benchmarks/allreduce_loopback.py --calibration cal.json

Writes benchmarks/results/allreduce_loopback[_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    log,
    machine,
    pyplot,
    result_paths,
    setup_logging,
    write_results,
)
from hybridpipe.comm.allreduce.bench import busbw_gbps
from hybridpipe.units import parse_sizes, size_label

ALGORITHMS = ("native", "ring", "butterfly", "hierarchical", "torus2d", "aggregator", "aggregator-dedicated", "auto")


def worker(rank: int, world: int, sizes: list[int], algorithms: list[str], reps: int, address: str | None,
           calibration: str | None) -> dict:
    """Runs on every rank; rank 0 returns {algorithm: {size: [seconds...]}} and what auto chose."""
    import torch
    import torch.distributed as dist

    from hybridpipe.comm.allreduce import AllReducer, Topology

    control = dist.new_group(backend="gloo")
    group = dist.new_group(backend="gloo")
    topology = Topology.blocks(world, 2)                # two pretend 'hosts' of 2: hierarchical has levels
    reducers = {"plain": AllReducer(group, topology=topology),
                # auto on the group as it is (one host), like the calibration that prices it
                "auto": AllReducer(group, topology=Topology.flat(world), calibration=calibration, lane=2)}
    if address:
        reducers["dedicated"] = AllReducer(group, topology=topology, aggregator=address, lane=1)
    times: dict[str, dict[int, list[float]]] = {a: {s: [] for s in sizes} for a in algorithms}
    wrong, chose = [], {}
    for size in sizes:
        x = torch.empty(size // 4)
        want = float(world * (world + 1) // 2)
        for rep in range(reps + 1):                     # the first round warms up
            shift = rep % len(algorithms)
            for algo in algorithms[shift:] + algorithms[:shift]:
                reducer = reducers[{"aggregator-dedicated": "dedicated", "auto": "auto"}.get(algo, "plain")]
                name = "aggregator" if algo == "aggregator-dedicated" else algo
                x.fill_(rank + 1)
                dist.barrier(group=control)
                t0 = time.perf_counter()
                ran = reducer(x, name)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
                if rep == 0:
                    if not bool((x == want).all()):
                        wrong.append(f"{algo} {size}")
                    if algo == "auto":
                        chose[size] = ran
                else:
                    times[algo][size].append(t.item())
    for r in reducers.values():
        r.close()
    return {"times": times, "wrong": wrong, "auto": chose} if rank == 0 else {}


def analyse(times: dict[str, dict[int, list[float]]], world: int) -> list[dict]:
    rows = []
    for algo, by_size in times.items():
        for size, ts in by_size.items():
            if not ts:
                continue
            med = statistics.median(ts)
            native = statistics.median(times["native"][size]) if "native" in times else None
            rows.append({"algorithm": algo, "bytes": size, "median_s": med, "min_s": min(ts), "reps": len(ts),
                         "busbw_gbps": busbw_gbps(size, med, world),
                         "ratio_to_native": med / native if native else None})
    return rows


def plot(rows: list[dict], world: int, title: str):
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    for algo in algos:
        pts = sorted((r["bytes"], r["median_s"] * 1e3, r["ratio_to_native"]) for r in rows if r["algorithm"] == algo)
        xs = [p[0] for p in pts]
        style = {"lw": 2.5, "ls": "--"} if algo == "auto" else {"lw": 1.2}
        ax.plot(xs, [p[1] for p in pts], marker="o", ms=3, label=algo, **style)
        ax2.plot(xs, [p[2] for p in pts], marker="o", ms=3, label=algo, **style)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        sizes = sorted({r["bytes"] for r in rows})
        a.set_xticks(sizes, [size_label(s) for s in sizes], fontsize=7)
        a.set_xlabel("message size")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("median latency (ms), slowest rank")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel("time / native's time (lower is better)")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 repetitions instead of 15")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes", default="4K..16M")
    p.add_argument("--size-step", type=int, default=4)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--calibration", default=None,
                   help="calibration for auto (hybridpipe bench-allreduce --ranks 4 output); default: nominal costs")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args(argv)
    setup_logging()
    from hybridpipe.comm.local import describe_failures, run_local

    reps = args.reps or (5 if args.quick else 15)
    sizes = parse_sizes(args.sizes, args.size_step)
    algorithms = args.algorithms.split(",")
    server, address = None, None
    if "aggregator-dedicated" in algorithms:
        server = subprocess.Popen([sys.executable, "-m", "hybridpipe.cli", "aggregator", "--port", "0", "--host",
                                   "127.0.0.1", "--world", str(args.ranks)], stdout=subprocess.PIPE, text=True)
        address = server.stdout.readline().split()[3]
    started = time.monotonic()
    try:
        outcomes = run_local(worker, args.ranks, sizes, algorithms, reps, address, args.calibration,
                             timeout_s=args.timeout)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    problems = describe_failures(outcomes)
    if problems:
        log.error("%s", problems)
        return 1
    out = outcomes[0].value
    rows = analyse(out["times"], args.ranks)
    for size in sizes:
        cells = "  ".join(f"{r['algorithm']} {r['ratio_to_native']:.2f}" for r in rows if r["bytes"] == size)
        log.info("%5s native %.2f ms | %s", size_label(size),
                 next(r["median_s"] for r in rows if r["bytes"] == size and r["algorithm"] == "native") * 1e3, cells)
    json_path, png_path = result_paths("allreduce_loopback", args.quick, args.out)
    data = {"benchmark": "allreduce_loopback", "quick": args.quick, "machine": machine(),
            "settings": {"ranks": args.ranks, "sizes": sizes, "reps": reps, "algorithms": algorithms,
                         "topology": "blocks of 2 ranks (hierarchical and torus2d see 2 hosts); auto: one host",
                         "threads_per_rank": 1, "calibration": args.calibration},
            "wrong_sums": out["wrong"], "auto_chose": {str(k): v for k, v in out["auto"].items()},
            "rows": rows, "duration_s": time.monotonic() - started}
    fig = plot(rows, args.ranks, f"all-reduce on {args.ranks} local processes (gloo, loopback): each vs native")
    write_results(json_path, data, fig, png_path)
    if out["wrong"]:
        log.error("wrong sums: %s", out["wrong"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
