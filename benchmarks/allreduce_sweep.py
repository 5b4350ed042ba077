"""Reproduction 1 (seeds 000, 001, 004): every all-reduce algorithm and torch's own, 4 KB .. 64 MB,
on 2, 4 and 8 emulated hosts at 1 Gbit/s (and 10 Gbit/s).

For each cluster it reports per algorithm and size the median latency (the slowest rank's, per
repetition), the bus bandwidth (algbw x 2(n-1)/n) and its fraction of the link rate, what
``auto`` picked, and where the crossovers fall (butterfly vs ring, torus2d vs ring, aggregator
vs ring). Every result is checked against the exact sum.

    sudo .venv/bin/python benchmarks/allreduce_sweep.py --quick        # a few minutes
    sudo .venv/bin/python benchmarks/allreduce_sweep.py                # the full sweep

Writes benchmarks/results/allreduce_sweep[_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (busbw_gbps, emit_result, machine, parse_size_range, pyplot, require_emulation,
                               result_paths, run_workers, setup_logging, size_label, summary, write_results,
                               log)

ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native", "auto")
PAIRS = (("butterfly", "ring"), ("torus2d", "ring"), ("aggregator", "ring"))


# ---- the worker (one per emulated host) ------------------------------------------------------

def make_allreduce(name: str, group):
    """A function ``tensor -> None`` that all-reduces (sums) in place with algorithm ``name``,
    plus a function telling which algorithm ``auto`` picked for a size (None otherwise)."""
    import torch.distributed as dist
    if name == "native":
        return (lambda t: dist.all_reduce(t, group=group)), None
    from hybridpipe.comm import allreduce as ar
    return ar.benchmark_handle(name, group)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")       # barriers and time reductions stay off the measured group
    group = dist.new_group(backend="gloo")
    sizes = parse_size_range(args.sizes, args.size_step)
    rows = []
    for algo in args.algorithms.split(","):
        try:
            run, picked = make_allreduce(algo, group)
        except Exception as e:                       # an algorithm that does not apply to this world size
            rows.append({"algorithm": algo, "error": f"{type(e).__name__}: {e}"})
            continue
        for nbytes in sizes:
            numel = nbytes // 4
            x = torch.full((numel,), float(rank + 1))
            try:
                run(x)
            except Exception as e:
                rows.append({"algorithm": algo, "bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
                dist.barrier(group=control)
                continue
            expected = world * (world + 1) / 2
            correct = bool(torch.all(x == expected))
            # Repetitions: enough for ~budget seconds, within [reps, 5 * reps]; same on all ranks.
            t0 = time.perf_counter()
            run(x)
            warm = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=control)
            reps = int(min(5 * args.reps, max(args.reps, args.budget / max(warm.item(), 1e-6))))
            times = []
            for _ in range(reps):
                dist.barrier(group=control)
                t0 = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
            row = {"algorithm": algo, "bytes": nbytes, "correct": correct, "times_s": slowest.tolist(),
                   **{f"{k}_s": v for k, v in summary(slowest.tolist()).items() if k in ("median", "min", "max")}}
            if picked is not None:
                row["picked"] = picked(nbytes)
            rows.append(row)
            if rank == 0:
                print(f"{algo:>12} {size_label(nbytes):>5} {row['median_s'] * 1e3:9.2f} ms"
                      f"{'' if correct else '  WRONG SUM'}", file=sys.stderr, flush=True)
    if rank == 0:
        emit_result({"world": world, "rows": rows})
    dist.barrier(group=control)
    dist.destroy_process_group()


# ---- analysis (pure) -------------------------------------------------------------------------

def crossovers(faster: dict[int, float], ring: dict[int, float]) -> list[dict]:
    """Sizes where the faster-at-small-sizes algorithm and ring swap places.

    ``faster``/``ring``: size -> median seconds. Returns one entry per sign change of
    (t_algo - t_ring) between consecutive common sizes: the last size where the first winner
    won and the first size where the other did.
    """
    sizes = sorted(set(faster) & set(ring))
    out = []
    for lo, hi in zip(sizes, sizes[1:]):
        a, b = faster[lo] < ring[lo], faster[hi] < ring[hi]
        if a != b:
            out.append({"between": [lo, hi], "below": "algo" if a else "ring", "from": "ring" if a else "algo"})
    return out


def analyse(config: dict, rows: list[dict]) -> dict:
    """Add busbw and fractions of the link rate; find the crossovers of each pair."""
    world, link = config["hosts"], config["rate_gbps"]
    for r in rows:
        if "median_s" in r:
            r["busbw_gbps"] = busbw_gbps(r["bytes"], r["median_s"], world)
            r["busbw_of_link"] = r["busbw_gbps"] / link if link else None
    by_algo: dict[str, dict[int, float]] = {}
    for r in rows:
        if "median_s" in r and r.get("correct", False):
            by_algo.setdefault(r["algorithm"], {})[r["bytes"]] = r["median_s"]
    cross = {}
    for a, b in PAIRS:
        if a in by_algo and b in by_algo:
            cross[f"{a}_vs_{b}"] = [{"between": c["between"],
                                     "below": a if c["below"] == "algo" else b,
                                     "from": a if c["from"] == "algo" else b}
                                    for c in crossovers(by_algo[a], by_algo[b])]
    best = {}
    for size in sorted({s for d in by_algo.values() for s in d}):
        cands = {a: d[size] for a, d in by_algo.items() if size in d and a != "auto"}
        if cands:
            best[size] = min(cands, key=cands.get)
    return {**config, "rows": rows, "crossovers": cross, "fastest": {str(k): v for k, v in best.items()}}


# ---- the driver ------------------------------------------------------------------------------

def plot(results: list[dict], title: str):
    """One panel per (rate, hosts): busbw / link rate against size, a line per algorithm."""
    plt = pyplot()
    rates = sorted({r["rate_gbps"] for r in results})
    hosts = sorted({r["hosts"] for r in results})
    fig, axes = plt.subplots(len(rates), len(hosts), figsize=(4.2 * len(hosts), 3.4 * len(rates)),
                             squeeze=False, sharex=True)
    for res in results:
        ax = axes[rates.index(res["rate_gbps"])][hosts.index(res["hosts"])]
        for algo in ALGORITHMS:
            pts = [(r["bytes"], r["busbw_of_link"]) for r in res["rows"]
                   if r["algorithm"] == algo and r.get("busbw_of_link") is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, lw=2.5 if algo == "auto" else 1.2,
                        ls="--" if algo == "auto" else "-", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{res['hosts']} hosts, {res['rate_gbps']:g} Gbit/s links", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ticks = sorted({r["bytes"] for r in res["rows"] if "bytes" in r})[::2]
        ax.set_xticks(ticks, [size_label(t) for t in ticks], fontsize=7, rotation=45)
    for ax in axes[-1]:
        ax.set_xlabel("message size")
    for row in axes:
        row[0].set_ylabel("busbw / link rate")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, hosts and repetitions (a few minutes)")
    p.add_argument("--hosts", default=None, help="comma-separated host counts (default 2,4,8)")
    p.add_argument("--rates", default=None, help="comma-separated link rates in Gbit/s (default 1,10; quick: 1)")
    p.add_argument("--sizes", default=None, help="size range, e.g. 4K..64M (quick: 4K..64M by x4)")
    p.add_argument("--size-step", type=int, default=None, help="factor between sizes (default 2; quick 4)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--reps", type=int, default=None, help="minimum timed repetitions (default 5; quick 3)")
    p.add_argument("--budget", type=float, default=None, help="seconds of repetitions per size (default 0.5)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per cluster run")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    quick = args.quick
    hosts = [int(h) for h in (args.hosts or "2,4,8").split(",")]
    rates = [float(r) for r in (args.rates or ("1" if quick else "1,10")).split(",")]
    sizes = args.sizes or "4K..64M"
    step = args.size_step or (4 if quick else 2)
    reps = args.reps or (3 if quick else 5)
    budget = args.budget if args.budget is not None else (0.2 if quick else 0.5)
    setup_logging()
    require_emulation()
    from tools.emucluster import EmulatedCluster
    json_path, png_path = result_paths("allreduce_sweep", quick, args.out)
    started = time.monotonic()
    results = []
    for rate in rates:
        for n in hosts:
            log.info("%d hosts at %g Gbit/s: %s, sizes %s step %d", n, rate, args.algorithms, sizes, step)
            t0 = time.monotonic()
            with EmulatedCluster(n, rate, mtu=args.mtu) as cluster:
                out = run_workers(cluster, __file__, ["--algorithms", args.algorithms, "--sizes", sizes,
                                                      "--size-step", str(step), "--reps", str(reps),
                                                      "--budget", str(budget)], timeout_s=args.timeout)
            res = analyse({"hosts": n, "rate_gbps": rate, "mtu": args.mtu, "seconds": time.monotonic() - t0},
                          out["rows"])
            results.append(res)
            for name, cs in res["crossovers"].items():
                log.info("  %s: %s", name, "; ".join(f"{c['below']} below {size_label(c['between'][1])}"
                                                     for c in cs) or "no crossover")
    data = {"benchmark": "allreduce_sweep", "quick": quick, "machine": machine(),
            "settings": {"hosts": hosts, "rates_gbps": rates, "sizes": sizes, "size_step": step, "reps": reps,
                         "budget_s": budget, "mtu": args.mtu, "algorithms": args.algorithms.split(","),
                         "latency_emulation": "none (netem unavailable; tbf only)"},
            "duration_s": time.monotonic() - started, "results": results}
    fig = plot(results, f"all-reduce busbw / link rate (gloo, emulated hosts, MTU {args.mtu})")
    write_results(json_path, data, fig, png_path)
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
