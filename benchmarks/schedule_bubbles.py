"""Schedules measured against their predictions: bubble fraction (from the runs' timelines) next
to the simulator's, and peak memory per rank next to the partitioner's, with and without
activation recomputation.

    python benchmarks/schedule_bubbles.py                      # mlp, 2 stages, 8 micro-batches
    python benchmarks/schedule_bubbles.py --model gpt --stages 2 --batch-size 4 --quick

The model is profiled here and cut into ``--stages`` compute-balanced stages
(``partition --strategy time``: the same cuts for every schedule). Each schedule runs through
hybridpipe's worker on local processes (gloo, one thread each) with its timeline trace; the
measured bubble of a rank is 1 - its compute share of the step (forward, backward, optimizer
step; ``hybridpipe timeline``'s table), averaged over ranks; the simulator's is its idle share
in the steady state with the plan's measured stage times (zb-h1: the backward split in half).
Memory: every rank's peak (``summary.json``'s ``memory``: on the CPU the bytes of the tensors
its stage holds) against the plan's ``memory_bytes`` for that schedule and recomputation.
Results: ``benchmarks/results/schedule_bubbles[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.plan import save_plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.pipeline.simulator import bubble_fraction, simulate  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402
from hybridpipe.runtime.config import build_parser, resolve  # noqa: E402
from hybridpipe.runtime.timeline import find_rank_traces, load_rank_trace  # noqa: E402
from hybridpipe.runtime.timeline_merge import merge_traces, phase_table  # noqa: E402
from hybridpipe.runtime.worker import run_worker  # noqa: E402


def run_plan(rank: int, world: int, plan_path: str, steps: int, run_dir: str) -> dict | None:
    args = build_parser().parse_args(["--plan", plan_path, "--steps", str(steps), "--lr", "0.01", "--seed", "1",
                                      "--run-dir", run_dir, "--trace-dir", f"{run_dir}/traces", "--no-progress",
                                      "--timeout", "120"])
    return run_worker(resolve(args, world), print_fn=lambda _: None)


def measured_bubble(trace_dir: Path) -> float:
    rows = phase_table(merge_traces([load_rank_trace(p) for p in find_rank_traces(trace_dir)]))
    return statistics.mean(1 - r.compute_share for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp[hidden=512]")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    p.add_argument("--quick", action="store_true", help="6 steps")
    p.add_argument("--out-dir")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    steps = 6 if a.quick else a.steps
    torch.set_num_threads(1)
    profile = profile_model(resolve_model(a.model), batch_size=a.batch_size, repeats=3, progress=False)
    cluster = Cluster((Level("local", a.stages, 8.0, 500.0),), 16.0)
    tmp = Path(tempfile.mkdtemp(prefix="bubbles."))
    rows = []
    for schedule in a.schedules.split(","):
        for recompute in ("none", "all"):
            plan = partition(profile, cluster, Request(workers=a.stages, strategy="time", schedule=schedule,
                                                       micro_batches=a.micro_batches, recompute=recompute)).plan
            path = tmp / f"{schedule}-{recompute}.json"
            save_plan(plan, path)
            run_dir = tmp / f"run-{schedule}-{recompute}"
            outcomes = run_local(run_plan, a.stages, str(path), steps, str(run_dir), timeout_s=600, pg_timeout_s=300)
            problems = describe_failures(outcomes)
            if problems:
                raise RuntimeError(problems)
            summary = json.loads((run_dir / "summary.json").read_text())
            row = {"schedule": schedule, "recompute": recompute, "step_ms": summary["measured_step_ms"],
                   "predicted_step_ms": plan.predicted_step_ms,
                   "bubble_measured": measured_bubble(run_dir / "traces"),
                   "bubble_simulated": bubble_fraction(simulate(plan)),
                   "memory": summary["memory"]}
            rows.append(row)
            mem = ", ".join(f"rank {m['rank']} {m['peak_bytes'] / 2**20:.2f}/{m['predicted_bytes'] / 2**20:.2f} MiB"
                            for m in row["memory"])
            print(f"{schedule:>6} recompute {recompute:>4}: {row['step_ms']:.1f} ms/step, bubble measured "
                  f"{row['bubble_measured']:.1%} simulated {row['bubble_simulated']:.1%}; memory measured/predicted "
                  f"{mem}")
    result = {"benchmark": "schedule_bubbles", "machine": machine(), "command": " ".join(sys.argv),
              "model": a.model, "stages": a.stages, "micro_batches": a.micro_batches, "batch_size": a.batch_size,
              "steps": steps, "rows": rows}
    json_path, png_path = result_paths("schedule_bubbles", a.quick, a.out_dir)
    write_results(json_path, result, _figure(rows), png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(rows: list[dict]):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [f"{r['schedule']}{' rc' if r['recompute'] == 'all' else ''}" for r in rows]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["bubble_measured"] for r in rows], 0.4, label="measured (timeline)")
    left.bar([i + 0.2 for i in x], [r["bubble_simulated"] for r in rows], 0.4, label="simulated")
    left.set_xticks(list(x), names, fontsize=7)
    left.set_ylabel("bubble fraction")
    left.legend(fontsize=7)
    peak = [max(m["peak_bytes"] for m in r["memory"]) / 2**20 for r in rows]
    pred = [max(m["predicted_bytes"] for m in r["memory"]) / 2**20 for r in rows]
    right.bar([i - 0.2 for i in x], peak, 0.4, label="measured peak (hungriest rank)")
    right.bar([i + 0.2 for i in x], pred, 0.4, label="predicted")
    right.set_xticks(list(x), names, fontsize=7)
    right.set_ylabel("MiB")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
