"""Reproduction 3 (seed 003): the p2p threading modes in real training, AlexNet 3+1 on 4 hosts at 1 Gbit/s.

The paper's AlexNet (``alexnet``: 96/256/384/384/256 filters, fc 9216-4096-4096-1000) split
after its feature extractor (conv1..conv5, pool, adaptive pool: the profile node ``avgpool``): stage 0 replicated on
hosts 0-2 (micro-batches round-robin, the conv gradients all-reduced among the three), stage 1
(fc1..fc3) on host 3, so every activation and gradient (256 x 6 x 6 floats per sample, the
paper's cut) crosses a 1 Gbit/s link into or out of host 3. Four emulated hosts
(``tools/emucluster``: network namespaces, ``tc tbf`` on both ends of each link), one
``launch.py`` process per host (env:// ranks = host index, gloo, one thread), schedule 1f1b
(the runtime's schedule for a replicated stage with a fixed per-step order, which ``sra`` needs;
pipedream's messages cross steps, so its ``sra`` would run as ``sa``).

The input is reduced to 3 x ``--image`` x ``--image`` (default 64; the paper: 224) so that four
workers fit on this machine's 2 cores; the adaptive pool keeps fc1 at 9216 inputs, so the
bytes on the wire per sample are exactly the paper's. Compute on 2 CPU cores is still far
slower than on the paper's GPUs, so communication is a smaller share of a step here.

For each p2p mode of ``--modes`` (``per-tensor``: PipeDream's thread per peer, direction and
tensor; ``sa``; ``sra``) the same plan trains ``--steps`` steps; step time = the slowest rank's
(launch.py's summary), median over the steps after ``--warmup``. Modes alternate over
``--rounds`` so drifting load hits all. Result: each mode's step time relative to per-tensor
(the paper: 0.834-0.932 for sa/sra on GPUs).

    sudo .venv/bin/python benchmarks/comm_threads.py --quick     # a few minutes
    sudo .venv/bin/python benchmarks/comm_threads.py

Writes benchmarks/results/comm_threads[_TAG][_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    REPO,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    setup_logging,
    worker_env,  # noqa: E402
    write_results,
)
from hybridpipe.jsonfile import write_json  # noqa: E402

MODES = ("per-tensor", "sa", "sra")
CUT_AFTER = "avgpool"   # alexnet's blocks: conv1 ... pool5, avgpool | flatten, drop1, fc1 ...


def make_plan(model: str, batch_size: int, micro_batches: int, cluster_file: Path, path: Path) -> dict:
    """Profile ``model`` (one thread) and write the 3+1 plan: nodes ..CUT_AFTER on ranks 0-2, the rest on rank 3.

    The partitioner's own split (4 workers, balanced compute) supplies every field of a valid plan; the stages are then
    replaced by the paper's fixed cut (the plan keeps the base's strategy field, which has no value for
    "by hand"; it is checked again when loaded)."""
    import torch

    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.plan import Stage, load_plan, save_plan
    from hybridpipe.partitioner.planner import Request, partition
    from hybridpipe.profiles.profiler import profile_model
    from hybridpipe.profiles.zoo import resolve_model

    torch.set_num_threads(1)
    profile = profile_model(resolve_model(model), batch_size=batch_size, repeats=2, progress=False)
    cluster = load_cluster(cluster_file)
    base = partition(profile, cluster, Request(workers=4, strategy="time", micro_batches=micro_batches,
                                               schedule="1f1b")).plan
    last = base.stages[-1].last_node
    cut = next(n.id for n in profile.nodes if n.name == CUT_AFTER)
    stages = (Stage(0, base.stages[0].first_node, cut, 3, (0, 1, 2)), Stage(1, cut + 1, last, 1, (3,)))
    save_plan(dataclasses.replace(base, stages=stages, predicted_step_ms=0.0,
                                  predicted_samples_per_s=0.0), path)
    plan = load_plan(path)
    return {"stages": [[s.first_node, s.last_node, list(s.ranks)] for s in plan.stages], "cut_after_node": cut,
            "micro_batches": plan.micro_batches, "batch_size": plan.batch_size}


def run_mode(cluster, plan_path: Path, mode: str, steps: int, run_dir: Path, timeout_s: float) -> dict[int, float]:
    """launch.py on every host with ``--comm-mode mode``; the job's step times (ms) from its summary."""
    cmd = [sys.executable, str(REPO / "launch.py"), "--plan", str(plan_path), "--steps", str(steps),
           "--comm-mode", mode, "--run-dir", str(run_dir), "--no-trace", "--no-progress",
           "--timeout", str(int(timeout_s))]
    cluster.run(cmd, timeout_s=timeout_s, env=lambda host: worker_env(cluster, host, 1), cwd=REPO)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {int(k): float(v) for k, v in summary["job_step_ms"].items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", type=int, default=64, help="input image side (default 64; the paper: 224)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch (default 16)")
    p.add_argument("--micro-batches", type=int, default=6, help="per step, round-robin over the 3 replicas (default 6)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each run's median")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rate", default="1gbit", help="link rate of every emulated host (tc tbf; default 1gbit)")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 rounds")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per training run")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.rounds = 6, 2, 2
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must name some of {', '.join(MODES)}")
    if a.micro_batches % 3:
        raise SystemExit("--micro-batches must be a multiple of 3 (three replicas of stage 0)")
    setup_logging()
    require_emulation()
    from tools.emucluster import EmulatedCluster

    model = f"alexnet[image={a.image}]"
    tmp = Path(tempfile.mkdtemp(prefix="comm_threads."))
    runs: dict[str, list[float]] = {m: [] for m in modes}
    step_ms: dict[str, list[dict]] = {m: [] for m in modes}
    load_before = [round(x, 2) for x in __import__("os").getloadavg()]
    started = time.monotonic()
    with EmulatedCluster(4, rate=a.rate) as cluster:
        cluster_file = tmp / "cluster.json"
        write_json(cluster_file, cluster.cluster_json())
        plan_path = tmp / "plan.json"
        plan_info = make_plan(model, a.batch_size, a.micro_batches, cluster_file, plan_path)
        log.info("%s, plan %s, %d x %d per step", model, plan_info["stages"], a.micro_batches, a.batch_size)
        for r in range(a.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                ms = run_mode(cluster, plan_path, mode, a.steps, tmp / f"run-{mode}-{r}", a.timeout)
                runs[mode].append(statistics.median(v for k, v in ms.items() if k >= a.warmup))
                step_ms[mode].append(ms)
                log.info("round %d %s: %.1f ms/step", r, mode, runs[mode][-1])
    medians = {m: statistics.median(v) for m, v in runs.items()}
    base = medians.get("per-tensor")
    result = {
        "benchmark": "comm_threads", "quick": a.quick, "machine": machine(), "command": " ".join(sys.argv),
        "load_average_before": load_before, "seconds": round(time.monotonic() - started, 1),
        "settings": {"model": model, "hosts": 4, "rate": a.rate, "schedule": "1f1b", "backend": "gloo",
                     "threads_per_process": 1, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
                     "cut_after": CUT_AFTER, **plan_info},
        "step_ms_per_round": runs, "median_step_ms": medians,
        "relative_to_per_tensor": {m: v / base for m, v in medians.items()} if base else {},
        "paper_relative_range": [0.834, 0.932],
        "job_step_ms": step_ms,
    }
    json_path, png_path = result_paths("comm_threads" + (f"_{a.tag}" if a.tag else ""), a.quick, a.out_dir)
    write_results(json_path, result, _figure(result), png_path)
    for m, v in medians.items():
        rel = f"  ({v / base:.3f} of per-tensor)" if base else ""
        print(f"{m:>11}: {v:8.1f} ms/step{rel}")
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = list(result["median_step_ms"])
    base = result["median_step_ms"].get("per-tensor")
    for i, m in enumerate(names):
        ref = base or result["median_step_ms"][m]
        ax.bar(i, result["median_step_ms"][m] / ref, color="#7f7f7f" if m == "per-tensor" else "#1f77b4")
        ax.plot([i] * len(result["step_ms_per_round"][m]), [v / ref for v in result["step_ms_per_round"][m]], "k.")
    lo, hi = result["paper_relative_range"]
    ax.axhspan(lo, hi, color="#2ca02c", alpha=0.15, label=f"paper (GPUs): {lo}-{hi}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("step time / per-tensor's (median; dots: rounds)")
    s = result["settings"]
    ax.set_title(f"{s['model']}, 3+1 stages, 4 hosts at {s['rate']}, {s['micro_batches']} x {s['batch_size']}, "
                 "1f1b, gloo", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
