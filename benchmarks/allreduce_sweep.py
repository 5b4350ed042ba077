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
import os
import sys
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    emit_result,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    run_workers,
    setup_logging,
    summary,
    worker_env,
    write_results,
)
from hybridpipe.comm.allreduce.bench import busbw_gbps
from hybridpipe.jsonfile import write_json
from hybridpipe.units import parse_sizes, size_label

ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d", "aggregator", "aggregator@switch", "native", "auto")
PAIRS = (("butterfly", "ring"), ("torus2d", "ring"), ("aggregator", "ring"), ("aggregator@switch", "ring"))
DEDICATED = "aggregator@switch"     # the dedicated aggregator in the switch's namespace (seed 001)
AGGREGATOR_PORT = 29600
TCP_MAX = 1448 / 1514      # TCP goodput / wire rate at MTU 1500: what a ring can reach at best
CALIBRATED = ("native", "ring", "butterfly", "hierarchical", "torus2d", "aggregator")   # auto's candidates
CALIBRATION_SIZES = "4K..16M"


# ---- the worker (one per emulated host) ------------------------------------------------------

def make_reducers(group, cluster_file: str, aggregator: str | None, calibration=None, downward=None) -> dict:
    """The algorithm name -> (reducer, algorithm) table of this run.

    ``auto`` prices the algorithms with the partitioner's cost model of the emulated cluster's
    description (its link rate; ``latency_us`` as given there), as a user passing
    ``--cluster cluster.json`` would, and with ``calibration`` (measured alpha/beta per
    algorithm, ``hybridpipe bench-allreduce`` or :func:`calibrate_group`) when one is given.
    """
    import torch.distributed as dist

    from hybridpipe.comm.allreduce import AllReducer, GroupCosts
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.cost.costmodel import CostModel
    cluster = load_cluster(cluster_file)
    ranks = tuple(range(dist.get_world_size(group)))
    plain = AllReducer(group, costs=GroupCosts(CostModel(cluster, calibration), ranks), downward=downward)
    table = {name: (plain, name) for name in ALGORITHMS if name != DEDICATED}
    if aggregator:
        switch = AllReducer(group, costs=GroupCosts(CostModel(cluster, calibration, aggregator_dedicated=True),
                                                    ranks), aggregator=aggregator, lane=1)
        table[DEDICATED] = (switch, "aggregator")
        table["_auto_with_switch"] = (switch, "auto")
    return table


def worker_calibration(args: argparse.Namespace):
    """The calibration ``auto`` prices with: a file, measured here first (``--calibrate``), or none."""
    from hybridpipe.comm.allreduce.bench import calibrate_group
    from hybridpipe.partitioner.cost.calibration import load_calibration
    if args.calibration_file:
        return load_calibration(args.calibration_file)
    if args.calibrate:
        algos = [a for a in CALIBRATED if a in args.algorithms.split(",") or a == "native"]
        return calibrate_group(algos, parse_sizes(CALIBRATION_SIZES, 4), reps=3, budget_s=0.1,
                               notes=("measured by allreduce_sweep before its sweep",))
    return None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = dist.new_group(backend="gloo")       # barriers and time reductions stay off the measured group
    group = dist.new_group(backend="gloo")
    down = None if args.one_connection else dist.new_group(backend="gloo")   # a connection per direction
    t0 = time.perf_counter()
    calibration = worker_calibration(args)
    calibration_s = time.perf_counter() - t0
    table = make_reducers(group, args.cluster_file, args.aggregator, calibration, down)
    sizes = parse_sizes(args.sizes, args.size_step)
    rows = []
    for algo in args.algorithms.split(","):
        if algo not in table:
            rows.append({"algorithm": algo, "error": "not available in this run (no dedicated aggregator)"})
            continue
        reducer, name = table[algo]
        for nbytes in sizes:
            x = torch.full((nbytes // 4,), float(rank + 1))
            try:
                ran = reducer(x, name)
            except Exception as e:                   # an algorithm that does not fit this group
                rows.append({"algorithm": algo, "bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
                dist.barrier(group=control)
                continue
            correct = bool(torch.all(x == world * (world + 1) / 2))
            x.zero_()                                # sums of zeros stay finite however often repeated
            # Repetitions: enough for ~budget seconds, within [reps, 5 * reps]; same on all ranks.
            t0 = time.perf_counter()
            reducer(x, name)
            warm = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=control)
            reps = int(min(5 * args.reps, max(args.reps, args.budget / max(warm.item(), 1e-6))))
            times = []
            for _ in range(reps):
                dist.barrier(group=control)
                t0 = time.perf_counter()
                reducer(x, name)
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
            stats = summary(slowest.tolist())
            row = {"algorithm": algo, "ran": ran, "bytes": nbytes, "correct": correct, "times_s": slowest.tolist(),
                   "median_s": stats["median"], "min_s": stats["min"], "max_s": stats["max"]}
            if algo == "auto":
                row["picked_with_switch"] = table["_auto_with_switch"][0].choose(nbytes) \
                    if "_auto_with_switch" in table else None
            rows.append(row)
            if rank == 0:
                print(f"{algo:>18} {size_label(nbytes):>5} {row['median_s'] * 1e3:9.2f} ms  ran {ran}"
                      f"{'' if correct else '  WRONG SUM'}", file=sys.stderr, flush=True)
    for reducer, _ in table.values():
        reducer.close()
    if rank == 0:
        from hybridpipe.comm.allreduce.bench import fits_summary
        emit_result({"world": world, "rows": rows,
                     "calibration": fits_summary(calibration) if calibration else None,
                     "calibration_s": calibration_s if calibration else None})
    dist.barrier(group=control)
    dist.destroy_process_group()


def serve_aggregator(args: argparse.Namespace) -> None:
    """The dedicated aggregator, run in the switch's namespace (killed at the cluster's teardown)."""
    from hybridpipe.comm.allreduce.dedicated import AggregatorServer
    server = AggregatorServer(args.bind, args.port, args.world)
    print(f"aggregator listening on {args.bind}:{args.port} for {args.world} workers", flush=True)
    server.serve()


# ---- analysis (pure) -------------------------------------------------------------------------

def crossovers(faster: dict[int, float], ring: dict[int, float]) -> list[dict]:
    """Sizes where the faster-at-small-sizes algorithm and ring swap places.

    ``faster``/``ring``: size -> median seconds. Returns one entry per sign change of
    (t_algo - t_ring) between consecutive common sizes: the last size where the first winner
    won and the first size where the other did.
    """
    sizes = sorted(set(faster) & set(ring))
    out = []
    for lo, hi in pairwise(sizes):
        a, b = faster[lo] < ring[lo], faster[hi] < ring[hi]
        if a != b:
            out.append({"between": [lo, hi], "below": "algo" if a else "ring", "from": "ring" if a else "algo"})
    return out


def settles(faster: dict[int, float], ring: dict[int, float]) -> dict | None:
    """The size from which one of the two wins at every larger size (robust to noisy flips below).

    Returns ``{"winner": "algo"|"ring", "from": size}`` or None without common sizes.
    """
    sizes = sorted(set(faster) & set(ring))
    if not sizes:
        return None
    wins = [faster[s] < ring[s] for s in sizes]
    k = len(sizes) - 1
    while k > 0 and wins[k - 1] == wins[-1]:
        k -= 1
    return {"winner": "algo" if wins[-1] else "ring", "from": sizes[k]}


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
    cross, settled = {}, {}
    for a, b in PAIRS:
        if a in by_algo and b in by_algo:
            cross[f"{a}_vs_{b}"] = [{"between": c["between"],
                                     "below": a if c["below"] == "algo" else b,
                                     "from": a if c["from"] == "algo" else b}
                                    for c in crossovers(by_algo[a], by_algo[b])]
            st = settles(by_algo[a], by_algo[b])
            if st:
                settled[f"{a}_vs_{b}"] = {"winner": a if st["winner"] == "algo" else b, "from": st["from"]}
    best = {}
    for size in sorted({s for d in by_algo.values() for s in d}):
        cands = {a: d[size] for a, d in by_algo.items() if size in d and a != "auto"}
        if cands:
            best[size] = min(cands, key=cands.get)
    auto = {}
    for r in rows:
        if r["algorithm"] == "auto" and "median_s" in r and r["bytes"] in best:
            fastest = by_algo[best[r["bytes"]]][r["bytes"]]
            auto[str(r["bytes"])] = {"picked": r.get("ran"), "picked_with_switch": r.get("picked_with_switch"),
                                     "fastest": best[r["bytes"]], "time_over_fastest": r["median_s"] / fastest}
    return {**config, "rows": rows, "crossovers": cross, "settles": settled,
            "fastest": {str(k): v for k, v in best.items()}, "auto": auto}


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
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", ms=3, lw=2.5 if algo == "auto" else 1.2,
                        ls="--" if algo == "auto" else "-", label=algo)
        ax.axhline(TCP_MAX, color="grey", ls=":", lw=1)
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
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="per-message latency in the cluster description auto prices with (default 50)")
    p.add_argument("--calibration", default=None,
                   help="auto prices with this calibration (hybridpipe bench-allreduce output)")
    p.add_argument("--calibrate", action="store_true",
                   help=f"auto prices with a calibration measured in each cluster first ({CALIBRATION_SIZES})")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--one-connection", action="store_true",
                   help="messages both ways on one gloo group (default: a group per direction, see transport.py)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cluster-file", help=argparse.SUPPRESS)
    p.add_argument("--calibration-file", help=argparse.SUPPRESS)
    p.add_argument("--aggregator", help=argparse.SUPPRESS)
    p.add_argument("--aggregator-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bind", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.aggregator_server:
        serve_aggregator(args)
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
    if args.calibration and args.calibrate:
        raise SystemExit("give --calibration FILE or --calibrate, not both")
    json_path, png_path = result_paths("allreduce_sweep" + (f"_{args.tag}" if args.tag else ""), quick, args.out)
    if args.calibration:
        from hybridpipe.partitioner.cost.calibration import load_calibration
        load_calibration(args.calibration)            # fail here, not in every worker
    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    for rate in rates:
        for n in hosts:
            log.info("%d hosts at %g Gbit/s: %s, sizes %s step %d", n, rate, args.algorithms, sizes, step)
            t0 = time.monotonic()
            with EmulatedCluster(n, rate, mtu=args.mtu) as cluster:
                cluster_file = Path(cluster.log_dir) / "cluster.json"
                write_json(cluster_file, cluster.cluster_json(latency_us=args.latency_us))
                worker_args = ["--algorithms", args.algorithms, "--sizes", sizes, "--size-step", str(step),
                               "--reps", str(reps), "--budget", str(budget), "--cluster-file", str(cluster_file)]
                if args.calibration:
                    worker_args += ["--calibration-file", str(Path(args.calibration).resolve())]
                elif args.calibrate:
                    worker_args.append("--calibrate")
                if args.one_connection:
                    worker_args.append("--one-connection")
                if DEDICATED in args.algorithms.split(","):
                    cluster.start(cluster.switch, [sys.executable, __file__, "--aggregator-server", "--bind",
                                                   cluster.switch.addr, "--port", str(AGGREGATOR_PORT),
                                                   "--world", str(n)], env=worker_env(cluster, cluster.switch))
                    worker_args += ["--aggregator", f"{cluster.switch.addr}:{AGGREGATOR_PORT}"]
                out = run_workers(cluster, __file__, worker_args, timeout_s=args.timeout)
            res = analyse({"hosts": n, "rate_gbps": rate, "mtu": args.mtu, "seconds": time.monotonic() - t0,
                           "calibration": out.get("calibration"), "calibration_s": out.get("calibration_s")},
                          out["rows"])
            log.info("  auto picked: %s", ", ".join(f"{size_label(int(k))} {v['picked']}"
                                                   for k, v in res["auto"].items()))
            results.append(res)
            for name, cs in res["crossovers"].items():
                st = res["settles"][name]
                log.info("  %s: %s wins from %s on (all swaps: %s)", name, st["winner"], size_label(st["from"]),
                         "; ".join(f"{c['below']} below {size_label(c['between'][1])}" for c in cs) or "none")
    data = {"benchmark": "allreduce_sweep", "quick": quick, "machine": machine(),
            "settings": {"hosts": hosts, "rates_gbps": rates, "sizes": sizes, "size_step": step, "reps": reps,
                         "budget_s": budget, "mtu": args.mtu, "algorithms": args.algorithms.split(","),
                         "connections": "one gloo group" if args.one_connection else "a gloo group per direction",
                         "auto_prices_with": f"cluster description: link rate, latency_us={args.latency_us:g}"
                         + (f"; calibration {args.calibration}" if args.calibration else "")
                         + (f"; calibration measured first in each cluster ({CALIBRATION_SIZES})"
                            if args.calibrate else ""),
                         "latency_emulation": "none (netem unavailable; tbf only)"},
            "duration_s": time.monotonic() - started, "load_average_before": load_before, "results": results}
    fig = plot(results, f"all-reduce busbw / link rate (gloo, emulated hosts, MTU {args.mtu})")
    write_results(json_path, data, fig, png_path)
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
