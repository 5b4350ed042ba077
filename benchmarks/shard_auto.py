"""``partition --shard auto`` where replicated-only needs more stages (issue 29's last figure): both plans
trained side by side on 4 emulated hosts at 1 Gbit/s (or on loopback).

1. Profile the zoo's small GPT (``gpt``: 4 layers, width 256, seq 128, vocab 2048; 4.2M parameters) at
   ``--batch`` samples per micro-batch, one thread, as each worker runs.
2. Pick the memory per worker: data parallelism on the 4 workers with AdamW, planned once replicated
   (``--strategy dp --shard none``) and once with ZeRO-1 (``--shard optimizer``), no limit; ``--memory-gb``
   is halfway between their per-worker needs (or as given), so the replicated model does not fit on
   one stage and ZeRO-1's does.
3. Plan ``--strategy optimal --shard none`` and ``--shard auto`` under that limit on
   ``examples/clusters/4x1gbit.json`` (the cluster tools/emucluster emulates).
4. Train each plan with ``launch.py`` under multi-node torchrun on 4 emulated hosts (``--network
   emulated``, root; the benchmark lock ``--lock`` held while measuring) or ``torchrun --standalone``
   on loopback, in ABBA order for ``--rounds`` rounds, and read each run's median step
   (``summary.json``, the steps after warm-up).

    sudo .venv/bin/python benchmarks/shard_auto.py                        # emulated, 2 rounds (ABBA)
    .venv/bin/python benchmarks/shard_auto.py --network loopback --quick

Writes benchmarks/results/shard_auto[_loopback][_quick].{json,png}: the commands, both plans (stages,
replicas, levels, predicted memory and step), every round's measured step, the load at start and end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    REPO,
    bench_lock,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    setup_logging,
    write_results,
)
from benchmarks.plans_steps import LAUNCH_TIMEOUT_S, hybridpipe_cli, train_plan
from hybridpipe.jsonfile import read_json

CLUSTER = REPO / "examples" / "clusters" / "4x1gbit.json"
SYSTEMS = ("none", "auto")


def cli(args: list[str], commands: list[str], threads: int | None = None) -> None:
    """Run ``hybridpipe ARGS`` (recorded in ``commands``); raise with its output on failure."""
    commands.append("hybridpipe " + " ".join(args))
    r = hybridpipe_cli(args, timeout_s=600, threads=threads)
    if r.returncode:
        raise RuntimeError(f"hybridpipe {' '.join(args)} failed:\n{(r.stderr or r.stdout)[-2000:]}")


def plan_args(profile: Path, out: Path, a: argparse.Namespace, shard: str, strategy: str,
              memory_gb: float) -> list[str]:
    return ["partition", str(profile), "--cluster", str(CLUSTER), "--optimizer", "adamw", "--micro-batches",
            str(a.micro_batches), "--strategy", strategy, "--shard", shard, "--memory-gb", f"{memory_gb:.6g}",
            "-q", "-o", str(out)]


def plan_row(plan: dict) -> dict:
    return {"stages": len(plan["stages"]), "replicas": [s["replicas"] for s in plan["stages"]],
            "nodes": [[s["first_node"], s["last_node"]] for s in plan["stages"]],
            "shard": [s.get("shard", "none") for s in plan["stages"]],
            "memory_gb": [round(s["memory_bytes"] / 1e9, 4) for s in plan["stages"]],
            "predicted_step_ms": round(plan["predicted_step_ms"], 1)}


def train_loopback(plan_file: Path, run_dir: Path, steps: int, port: int, timeout_s: float) -> dict:
    """``torchrun --standalone`` with one process per rank of the plan; the summary.json."""
    world = sum(s["replicas"] for s in read_json(plan_file, "plan")["stages"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--master-port", str(port), "launch.py", "--plan", str(plan_file), "--steps", str(steps), "--run-dir",
           str(run_dir), "--no-trace", "--no-progress", "--timeout", str(LAUNCH_TIMEOUT_S)]
    t = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        return {"failed": (r.stderr or r.stdout)[-2000:], "wall_s": time.monotonic() - t}
    summary = read_json(run_dir / "summary.json", "summary")
    summary["wall_s"] = time.monotonic() - t
    return summary


def figure(result: dict):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for k, name in enumerate(SYSTEMS):
        row = result["plans"][name]
        rounds = result["measured_step_ms"][name]
        label = (f"--shard {name}: {row['stages']} stage(s) x {row['replicas']}, "
                 f"{'/'.join(sorted(set(row['shard'])))}")
        ax.bar(k, statistics.median(rounds), label=label, alpha=0.8)
        ax.scatter([k] * len(rounds), rounds, color="k", s=12, zorder=3)
        ax.scatter([k], [row["predicted_step_ms"]], marker="_", s=400, color="r", zorder=4)
    ax.set_xticks(range(len(SYSTEMS)), [f"--shard {s}" for s in SYSTEMS])
    ax.set_ylabel("step (ms): median bar, rounds dots, predicted red")
    ax.set_title(f"GPT 4.2M, AdamW, {result['memory_gb']:.3g} GB per worker, {result['network']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower center")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--memory-gb", type=float, default=None, help="default: halfway (step 2 of the docstring)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="rounds of both plans, in ABBA order")
    p.add_argument("--network", choices=("emulated", "loopback"), default="emulated")
    p.add_argument("--rate", default="1gbit", help="emulated link rate (the cluster file says 1 Gbit/s)")
    p.add_argument("--lock", default="/tmp/hybridpipe-bench.lock", help="benchmark lock ('' for none)")
    p.add_argument("--quick", action="store_true", help="5 steps, 1 round")
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.rounds = 5, 1
    setup_logging()
    work = Path(tempfile.mkdtemp(prefix="shard_auto."))
    commands: list[str] = []
    profile = work / "gpt.profile.json"
    cli(["profile", a.model, "-b", str(a.batch), "--repeats", "2", "-q", "-o", str(profile)], commands, threads=1)
    need = {}
    for shard in ("none", "optimizer"):
        out = work / f"dp-{shard}.json"
        cli(plan_args(profile, out, a, shard, "dp", 1000.0), commands)
        need[shard] = read_json(out, "plan")["stages"][0]["memory_bytes"] / 1e9
    memory_gb = a.memory_gb or (need["none"] + need["optimizer"]) / 2
    plans, files = {}, {}
    for shard in SYSTEMS:
        files[shard] = work / f"plan-{shard}.json"
        cli(plan_args(profile, files[shard], a, shard, "optimal", memory_gb), commands)
        plans[shard] = plan_row(read_json(files[shard], "plan"))
        log.info("--shard %s: %s", shard, plans[shard])
    measured: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    summaries: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    port = 29650 + os.getpid() % 100
    with contextlib.ExitStack() as stack:
        cluster = None
        if a.network == "emulated":
            require_emulation()
            from tools.emucluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(4, rate=a.rate))
            stack.enter_context(bench_lock(a.lock))
        load = os.getloadavg()[0]
        for r in range(a.rounds):
            for k, shard in enumerate(SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                run_dir = work / f"run-{shard}-{r}"
                args = (files[shard], run_dir, a.steps, port + 2 * r + k, 900)
                summary = train_plan(cluster, *args) if cluster is not None else train_loopback(*args)
                if "failed" in summary:
                    raise RuntimeError(f"--shard {shard} failed to train:\n{summary['failed']}")
                measured[shard].append(summary["measured_step_ms"])
                summaries[shard].append({k: summary.get(k) for k in ("measured_step_ms", "job_step_ms", "wall_s")})
                log.info("round %d --shard %s: %.0f ms/step", r, shard, measured[shard][-1])
        load_end = os.getloadavg()[0]
    medians = {s: statistics.median(v) for s, v in measured.items()}
    result = {"benchmark": "shard_auto", "command": " ".join(["benchmarks/shard_auto.py", *(argv or sys.argv[1:])]),
              "machine": machine(), "commands": commands, "cluster": str(CLUSTER.relative_to(REPO)),
              "network": "loopback" if cluster is None else f"emulated 4 hosts at {a.rate}",
              "model": a.model, "batch": a.batch, "micro_batches": a.micro_batches, "steps": a.steps,
              "rounds": a.rounds, "dp_memory_gb": need, "memory_gb": memory_gb, "plans": plans,
              "measured_step_ms": measured, "median_step_ms": medians,
              "round_spread": {s: max(v) / min(v) - 1 for s, v in measured.items()},
              "auto_speedup": medians["none"] / medians["auto"],
              "predicted_speedup": plans["none"]["predicted_step_ms"] / plans["auto"]["predicted_step_ms"],
              "load_at_start": load, "load_at_end": load_end, "runs": summaries}
    name = "shard_auto" + ("_loopback" if cluster is None else "")
    json_path, png_path = result_paths(name, a.quick, a.out_dir)
    write_results(json_path, result, figure(result), png_path)
    for s in SYSTEMS:
        print(f"--shard {s:4s} {plans[s]['stages']} stage(s) x {plans[s]['replicas']} {plans[s]['shard']}: "
              f"predicted {plans[s]['predicted_step_ms']:.0f} ms, measured {medians[s]:.0f} ms "
              f"(rounds {', '.join(f'{x:.0f}' for x in measured[s])})")
    print(f"--shard auto {result['auto_speedup']:.2f}x the speed of --shard none (predicted "
          f"{result['predicted_speedup']:.2f}x); {result['network']}; load {load:.1f} -> {load_end:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
