"""How long ``hybridpipe partition --strategy optimal`` takes as the graph and the cluster grow, before and after.

Times the whole optimal strategy (the data-parallel bound, the DP over every copy count, the tie
pass) on seeded synthetic profiles (a conv-like front with big activations and small weights, an
FC-like tail with big weights, skip connections every few nodes) on 2-level clusters of 8 workers
per host, from a cold cost model, each case in its own process (wall and CPU seconds, peak memory):

* ``after``: the solver in ``hybridpipe/partitioner/search/dp.py``;
* ``before``: the exhaustive solver it replaced (``tests/partitioner/reference_dp.py``), run only
  where its O(N^2 W^2) cost, extrapolated from the biggest case run so far, stays under ``--before-limit``
  seconds (the others are listed as skipped, with the estimate); where both finish, the JSON says
  whether they returned the same plan.

With ``--pipedream-src DIR`` (a checkout of msr-fiddle/pipedream: ``DIR/optimizer/
optimizer_graph_hierarchical.py``, ``DIR/graph/graph.py``) it also times PipeDream's own optimizer on
PipeDream's ResNet-50 profile (``tests/partitioner/data/pipedream/resnet50.graph.txt``) next to
hybridpipe's ``optimal`` and ``pipedream`` strategies on the imported profile, on the same clusters
(memory unchecked, as PipeDream's optimizer by default).

    .venv/bin/python benchmarks/partitioner_speed.py                 # JSON + PNG in benchmarks/results/
    .venv/bin/python benchmarks/partitioner_speed.py --quick
    .venv/bin/python benchmarks/partitioner_speed.py --pipedream-src /path/to/pipedream
    .venv/bin/python benchmarks/partitioner_speed.py --write-inputs 50 4096 DIR   # for the CLI:
    hybridpipe partition DIR/synthetic-50.profile.json --cluster DIR/cluster-4096.json -o plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.profiles.format import Profile, ProfileNode, save_profile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESNET = REPO / "tests" / "partitioner" / "data" / "pipedream" / "resnet50.graph.txt"
PER_HOST = 8
FULL_NODES, FULL_WORKERS = (50, 200, 500, 1000), (64, 256, 1024, 4096)
QUICK_NODES, QUICK_WORKERS = (50, 200), (64, 256)
PIPEDREAM_HOSTS = ((4, 4), (8, 4), (8, 8), (8, 16))           # (workers per host, hosts)
INNER_GBPS, NETWORK_GBPS = 100.0, 1.0


def synthetic_profile(n_nodes: int, seed: int = 0) -> Profile:
    """A chain of ``n_nodes`` (input and output included) with a skip edge every 7 nodes."""
    rng = random.Random(seed)
    layers = n_nodes - 2
    nodes = [ProfileNode(0, "x", "ops", "x", "ops", activation_bytes=64 * 3 * 224 * 224 * 4)]
    for k in range(1, layers + 1):
        front = k < 0.8 * layers                              # conv-like front, FC-like tail
        act = int(rng.uniform(0.5, 8.0) * 2**20) if front else int(rng.uniform(4, 64) * 2**10)
        par = int(rng.choice([0, 0, rng.uniform(0.01, 4.0)]) * 2**20) if front else int(rng.uniform(4, 64) * 2**20)
        fwd = rng.uniform(0.5, 12.0) if front else rng.uniform(0.1, 2.0)
        params = (f"layer{k}.weight",) if par else ()
        nodes.append(ProfileNode(k, f"layer{k}", "module", f"layer{k}", "Conv2d" if front else "Linear",
                                 fwd, 2 * fwd, act, par // 4, par, params))
    nodes.append(ProfileNode(layers + 1, "output", "ops", "output", "ops", 0.05, 0.05))
    edges = {(k, k + 1) for k in range(layers + 1)} | {(k, k + 3) for k in range(1, layers - 2, 7)}
    return Profile(f"synthetic-{n_nodes}", 64, (64, 3, 224, 224), "float32", "float32", "cpu", "synthetic",
                   tuple(nodes), tuple(sorted(edges)))


def cluster(per_host: int, hosts: int) -> Cluster:
    return Cluster((Level("node", per_host, INNER_GBPS, 5.0), Level("network", hosts, NETWORK_GBPS, 50.0)), 32.0)


# ---- one case, in its own process --------------------------------------------------------------
def run_case(nodes: int, workers: int, solver: str, strategy: str = "optimal", profile: str | None = None) -> dict:
    """Partition once; wall and CPU seconds, peak memory, the plan's figures."""
    from hybridpipe.commands.import_pipedream import profile_from_graph
    from hybridpipe.partitioner.planner import Request, partition
    from hybridpipe.partitioner.search import dp
    if solver == "before":
        from tests.partitioner import reference_dp

        def before(costs, model, w, opts, bound=math.inf, **_):
            old = reference_dp.solve(costs, model, w, opts, bound)
            return dp.Solution(old.stages, old.objective_ms, old.copies)
        dp.solve = before
    prof = profile_from_graph(Path(profile).read_text(), "pipedream-resnet50") if profile else synthetic_profile(nodes)
    wall, cpu = time.perf_counter(), time.process_time()
    # ResNet-50 next to PipeDream's optimizer, which checks no memory by default: neither does this run
    out = partition(prof, cluster(PER_HOST if workers >= PER_HOST else workers, max(1, workers // PER_HOST)),
                    Request(strategy=strategy, memory_gb=1e6 if profile else None))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    plan = out.plan
    return {"nodes": len(prof.nodes), "workers": workers, "solver": solver, "strategy": strategy, "wall_s": wall,
            "cpu_s": cpu, "peak_rss_mb": peak_rss_mb(),
            "objective_ms": out.evaluation.objective_ms, "predicted_step_ms": plan.predicted_step_ms,
            "stages": [[s.first_node, s.last_node, s.replicas] for s in plan.stages]}


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (``VmHWM``; ``ru_maxrss`` would also count the
    parent's pages at fork)."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pipedream(src: str, per_host: int, hosts: int) -> dict:
    """PipeDream's optimizer (its own code, imported from ``src``) on its ResNet-50 profile: wall seconds."""
    sys.modules.setdefault("graphviz", types.ModuleType("graphviz"))   # only its plotting needs graphviz
    sys.path[:0] = [str(Path(src) / "optimizer"), src]
    import optimizer_graph_hierarchical as pd
    flags = {"straight_pipeline": False, "use_memory_constraint": False, "use_fewer_machines": False,
             "activation_compression_ratio": None, "memory_size": 16e9}
    for name, value in flags.items():
        setattr(pd, name, value)                                # its __main__ block sets these as globals
    wall = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        pd.main([per_host, hosts], str(RESNET), [INNER_GBPS * 1e9 / 8, NETWORK_GBPS * 1e9 / 8], 16e9, False, False,
                False, None, None, print_configuration=False)
    return {"workers": per_host * hosts, "wall_s": time.perf_counter() - wall}


def in_process(args: list[str], timeout: float) -> dict | None:
    """Run one case in a fresh process; None when it ran out of time, {"skipped": why} when it died."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        why = f"killed by signal {-done.returncode} (out of memory?)" if done.returncode < 0 else \
            (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"skipped": f"failed after {time.perf_counter() - start:.0f} s: {why}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the driver ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke test)")
    ap.add_argument("--nodes", help="comma-separated node counts (default 50,200,500,1000)")
    ap.add_argument("--workers", help="comma-separated worker counts, multiples of 8 (default 64,256,1024,4096)")
    ap.add_argument("--before-limit", type=float, default=300.0,
                    help="skip 'before' cases estimated to take longer than this many seconds (default 300)")
    ap.add_argument("--pipedream-src", metavar="DIR", help="also time PipeDream's optimizer from this checkout")
    ap.add_argument("--out-dir", help="where to write the JSON and PNG (default benchmarks/results/)")
    ap.add_argument("--write-inputs", nargs=3, metavar=("NODES", "WORKERS", "DIR"),
                    help="only write a case's profile and cluster JSON into DIR (to time `hybridpipe partition`)")
    ap.add_argument("--case", nargs=2, type=int, metavar=("NODES", "WORKERS"), help=argparse.SUPPRESS)
    ap.add_argument("--solver", default="after", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="optimal", help=argparse.SUPPRESS)
    ap.add_argument("--resnet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pipedream-case", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_inputs:
        n, w, out = int(args.write_inputs[0]), int(args.write_inputs[1]), Path(args.write_inputs[2])
        out.mkdir(parents=True, exist_ok=True)
        save_profile(synthetic_profile(n), out / f"synthetic-{n}.profile.json")
        clu = cluster(PER_HOST if w >= PER_HOST else w, max(1, w // PER_HOST))
        (out / f"cluster-{w}.json").write_text(json.dumps(clu.to_dict(), indent=1))
        print(f"wrote {out}/synthetic-{n}.profile.json and {out}/cluster-{w}.json")
        return 0
    if args.case:
        print(json.dumps(run_case(*args.case, args.solver, args.strategy, str(RESNET) if args.resnet else None)))
        return 0
    if args.pipedream_case:
        print(json.dumps(run_pipedream(args.pipedream_src, *args.pipedream_case)))
        return 0
    setup_logging()
    nodes = [int(x) for x in args.nodes.split(",")] if args.nodes else QUICK_NODES if args.quick else FULL_NODES
    workers = [int(x) for x in args.workers.split(",")] if args.workers else \
        QUICK_WORKERS if args.quick else FULL_WORKERS
    json_path, png_path = result_paths("partitioner_speed", args.quick, args.out_dir)
    head = {"benchmark": "partitioner_speed", "machine": machine(), "before_limit_s": args.before_limit}
    rows = speed_grid(nodes, workers, args.before_limit)
    write_results(json_path, {**head, "load_avg": os.getloadavg(), "synthetic": rows}, figure(rows), png_path)
    resnet = resnet_rows(args.pipedream_src, args.before_limit) if args.pipedream_src else []
    write_results(json_path, {**head, "load_avg": os.getloadavg(), "synthetic": rows, "resnet50": resnet})
    print(table(rows))
    print(f"wrote {json_path} and {png_path}")
    return 0


def speed_grid(nodes: list[int], workers: list[int], limit: float) -> list[dict]:
    """Every (nodes, workers) case after, and before where its estimated cost is under ``limit``."""
    rows, scale, largest = [], None, 0
    for w in workers:
        for n in nodes:
            after = in_process(["--case", str(n), str(w)], timeout=3600)
            row = {"nodes": n, "workers": w, "after": after}
            estimate = None if scale is None else scale * n * n * w * w
            if estimate is not None and estimate > limit:
                row["before"] = {"skipped": f"estimated {estimate:.0f} s (> {limit:g} s)"}
            else:
                before = in_process(["--case", str(n), str(w), "--solver", "before"], timeout=1.5 * limit)
                row["before"] = before or {"skipped": f"stopped after {1.5 * limit:.0f} s"}
                before = before if before and "skipped" not in before else None
                if before:
                    row["same_plan"] = (before["stages"], before["objective_ms"]) == \
                        (after["stages"], after["objective_ms"])
                if before and n * n * w * w >= largest:       # extrapolate from the biggest case run
                    scale, largest = before["wall_s"] / (n * n * w * w), n * n * w * w
            rows.append(row)
            print(line(row), flush=True)
    return rows


def resnet_rows(src: str, limit: float) -> list[dict]:
    """PipeDream's optimizer vs hybridpipe's optimal and pipedream strategies on ResNet-50."""
    out = []
    for per_host, hosts in PIPEDREAM_HOSTS:
        w = per_host * hosts
        theirs = in_process(["--pipedream-case", str(per_host), str(hosts), "--pipedream-src", src], timeout=limit)
        theirs = theirs if theirs and "skipped" not in theirs else None
        mine = in_process(["--case", "0", str(w), "--resnet"], timeout=3600)
        strategy = in_process(["--case", "0", str(w), "--resnet", "--strategy", "pipedream"], timeout=3600)
        row = {"workers": w, "hosts": [per_host, hosts], "pipedream_optimizer": theirs or {"stopped_after_s": limit},
               "optimal": mine, "pipedream_strategy": strategy}
        out.append(row)
        theirs_s = f"{theirs['wall_s']:.2f} s" if theirs else f"> {limit:g} s"
        print(f"ResNet-50 on {w} workers ({per_host} x {hosts}): PipeDream's optimizer {theirs_s} | hybridpipe "
              f"optimal {mine['wall_s']:.2f} s | --strategy pipedream {strategy['wall_s']:.2f} s", flush=True)
    return out


def line(row: dict) -> str:
    a, b = row["after"], row["before"]
    before = f"{b['wall_s']:8.2f} s" if "wall_s" in b else f"skipped ({b['skipped']})"
    return (f"{row['nodes']:5d} nodes {row['workers']:5d} workers: after {a['wall_s']:7.2f} s "
            f"(cpu {a['cpu_s']:6.2f}, {a['peak_rss_mb']:5.0f} MB)  before {before}"
            + (f"  same plan: {row['same_plan']}" if "same_plan" in row else ""))


def table(rows: list[dict]) -> str:
    out = ["| nodes | workers | before: wall s | after: wall s | after: CPU s | after: peak MB | same plan |",
           "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        b = r["before"]
        before = f"{b['wall_s']:.2f}" if "wall_s" in b else f"skipped: {b['skipped']}"
        a = r["after"]
        same = "-" if "same_plan" not in r else "yes" if r["same_plan"] else "NO"
        out.append(f"| {r['nodes']} | {r['workers']} | {before} | {a['wall_s']:.2f} | {a['cpu_s']:.2f} | "
                   f"{a['peak_rss_mb']:.0f} | {same} |")
    return "\n".join(out)


def figure(rows: list[dict]):
    plt = pyplot()
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, n in enumerate(sorted({r["nodes"] for r in rows})):
        mine = [r for r in rows if r["nodes"] == n]
        color = f"C{k}"
        ax.plot([r["workers"] for r in mine], [r["after"]["wall_s"] for r in mine], marker="o", color=color,
                label=f"{n} nodes, after")
        done = [r for r in mine if "wall_s" in r["before"]]
        ax.plot([r["workers"] for r in done], [r["before"]["wall_s"] for r in done], marker="x", linestyle="--",
                color=color, label=f"{n} nodes, before")
        mem.plot([r["workers"] for r in mine], [r["after"]["peak_rss_mb"] for r in mine], marker="o", color=color,
                 label=f"{n} nodes")
    for a, label in ((ax, "wall seconds"), (mem, "peak memory, MB (after)")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("workers (8 per host)")
        a.set_ylabel(label)
    ax.axhline(5, color="grey", linestyle=":", linewidth=1)
    ax.axhline(30, color="grey", linestyle=":", linewidth=1)
    ax.set_title("partition --strategy optimal: before (dashed) and after")
    ax.legend(fontsize=7, ncol=2)
    mem.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    sys.exit(main())
