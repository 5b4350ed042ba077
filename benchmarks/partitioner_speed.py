"""How long ``hybridpipe partition --strategy optimal`` takes as the graph and the cluster grow.

Times the whole optimal strategy (the data-parallel bound, the DP over every copy count, the
tie pass) on seeded synthetic profiles (a conv-like front with big activations and small
weights, an FC-like tail with big weights, skip connections every few nodes) for growing node
counts, on 2-level clusters (hosts x workers per host) of growing size, from a cold cost model
each time, as a user's run starts. Reports wall and CPU seconds (the median of ``--repeats``);
on a shared machine CPU seconds are the fairer number. Optionally also times a real profile.

    .venv/bin/python benchmarks/partitioner_speed.py                 # JSON + PNG in benchmarks/results/
    .venv/bin/python benchmarks/partitioner_speed.py --quick
    .venv/bin/python benchmarks/partitioner_speed.py --profile profiles/resnet50.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.partitioner.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.profiles.format import Profile, ProfileNode, load_profile  # noqa: E402

FULL_NODES = (25, 50, 100, 200)
FULL_CLUSTERS = ((4, 2), (4, 4), (8, 4), (8, 8))         # (workers per host, hosts)
QUICK_NODES = (25, 50)
QUICK_CLUSTERS = ((4, 2), (4, 4))


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
    return Cluster((Level("node", per_host, 100.0, 5.0), Level("network", hosts, 1.0, 50.0)), 32.0)


def time_once(profile: Profile, clu: Cluster) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    plan = partition(profile, clu, Request()).plan
    return time.perf_counter() - wall, time.process_time() - cpu, len(plan.stages)


def measure(profile: Profile, clu: Cluster, repeats: int) -> dict:
    runs = [time_once(profile, clu) for _ in range(repeats)]
    return {"nodes": len(profile.nodes), "workers": clu.total_workers,
            "levels": [[lv.name, lv.workers] for lv in clu.levels],
            "wall_s": statistics.median(r[0] for r in runs), "cpu_s": statistics.median(r[1] for r in runs),
            "wall_all_s": [r[0] for r in runs], "stages": runs[0][2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke test)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="append", default=[], help="also time this real profile (repeatable)")
    ap.add_argument("--out-dir", help="where to write the JSON and PNG (default benchmarks/results/)")
    args = ap.parse_args(argv)
    setup_logging()
    nodes, clusters = (QUICK_NODES, QUICK_CLUSTERS) if args.quick else (FULL_NODES, FULL_CLUSTERS)
    rows = []
    for per_host, hosts in clusters:
        for n in nodes:
            row = measure(synthetic_profile(n), cluster(per_host, hosts), args.repeats)
            rows.append(row)
            print(f"{row['nodes']:4d} nodes  {row['workers']:3d} workers ({per_host} x {hosts})  "
                  f"wall {row['wall_s']:7.3f} s  cpu {row['cpu_s']:7.3f} s  {row['stages']} stages", flush=True)
    real = []
    for path in args.profile:
        prof = load_profile(path)
        for per_host, hosts in clusters:
            row = measure(prof, cluster(per_host, hosts), args.repeats)
            row["profile"] = str(path)
            real.append(row)
            print(f"{path}: {row['nodes']} nodes, {row['workers']} workers: wall {row['wall_s']:.3f} s, "
                  f"cpu {row['cpu_s']:.3f} s", flush=True)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for workers in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == workers]
        ax.plot([r["nodes"] for r in mine], [r["cpu_s"] for r in mine], marker="o", label=f"{workers} workers")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("profile nodes")
    ax.set_ylabel("CPU seconds (median)")
    ax.set_title("hybridpipe partition --strategy optimal (2-level clusters)")
    ax.legend()
    json_path, png_path = result_paths("partitioner_speed", args.quick, args.out_dir)
    write_results(json_path, {"benchmark": "partitioner_speed", "machine": machine(), "repeats": args.repeats,
                              "synthetic": rows, "profiles": real}, fig, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
