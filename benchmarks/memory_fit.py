"""The largest batch that fits a memory limit, with and without activation recomputation.

    python benchmarks/memory_fit.py --memory-gb 0.1                 # gpt and resnet-small, 2 stages
    python benchmarks/memory_fit.py --models gpt --memory-gb 0.2 --schedules gpipe --quick

For each model, schedule and ``--recompute`` mode, the partitioner (``--strategy optimal`` on
``--workers`` 2, ``--micro-batches M``; it picks stages and replicas) is asked for a plan at
growing micro-batch sizes, each profiled
at that size: doubling until no plan fits in ``--memory-gb`` per worker, then bisecting. The
largest batch is that micro-batch size x M. The plan found for it is then run for a few steps
on local processes (gloo, one thread each) and every rank's measured peak (``summary.json``: on
the CPU the bytes of the tensors its stage holds) is reported next to the prediction and the
limit. With 1f1b a stage holds at most as many micro-batches as the stages after it, so M does
not bound the batch there; the micro-batch size does. Results:
``benchmarks/results/memory_fit[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import bench_lock, machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from benchmarks.schedule_bubbles import run_plan  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.errors import UserError  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.plan import Plan, save_plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.profiles.format import Profile  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402


class Search:
    """Plans for one model at growing micro-batch sizes (profiles cached per size)."""

    def __init__(self, model: str, workers: int, memory_gb: float, micro_batches: int):
        self.model, self.workers, self.micro_batches = model, workers, micro_batches
        self.cluster = Cluster((Level("local", workers, 8.0, 500.0),), memory_gb)
        self.profiles: dict[int, Profile] = {}

    def profile(self, size: int) -> Profile:
        if size not in self.profiles:
            self.profiles[size] = profile_model(resolve_model(self.model), batch_size=size, repeats=1, warmup=0,
                                                progress=False)
        return self.profiles[size]

    def plan(self, size: int, schedule: str, recompute: str) -> Plan | None:
        """The partitioner's plan at this micro-batch size, None where none fits."""
        req = Request(workers=self.workers, schedule=schedule, micro_batches=self.micro_batches, recompute=recompute)
        try:
            return partition(self.profile(size), self.cluster, req).plan
        except UserError as e:
            if "fits in" not in str(e):         # not a memory refusal: a mistake in this script
                raise
            return None

    def largest(self, schedule: str, recompute: str, most: int) -> tuple[int, Plan | None, list[int]]:
        """(largest micro-batch size with a plan, its plan, sizes tried): doubling, then bisection."""
        tried: list[int] = []
        best, best_plan, size = 0, None, 1
        while size <= most:
            tried.append(size)
            plan = self.plan(size, schedule, recompute)
            if plan is None:
                break
            best, best_plan, size = size, plan, size * 2
        high = min(size, most + 1)
        while high - best > 1:
            mid = (best + high) // 2
            tried.append(mid)
            plan = self.plan(mid, schedule, recompute)
            if plan is None:
                high = mid
            else:
                best, best_plan = mid, plan
        return best, best_plan, tried


def verify(plan: Plan, steps: int, workdir: Path, name: str) -> list[dict]:
    """Run ``plan`` for ``steps`` steps; every rank's measured peak and predicted bytes."""
    path = workdir / f"{name}.json"
    save_plan(plan, path)
    run_dir = workdir / f"run-{name}"
    world = sum(s.replicas for s in plan.stages)
    outcomes = run_local(run_plan, world, str(path), steps, str(run_dir), timeout_s=900, pg_timeout_s=600)
    problems = describe_failures(outcomes)
    if problems:
        raise RuntimeError(problems)
    return json.loads((run_dir / "summary.json").read_text())["memory"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,resnet-small")
    p.add_argument("--memory-gb", type=float, default=0.1, help="memory per worker (default 0.1)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--recompute", default="none,all,auto")
    p.add_argument("--max-micro-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 steps")
    p.add_argument("--lock", default="/tmp/hybridpipe-bench.lock", help="benchmark lock file ('' for none)")
    p.add_argument("--out-dir")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    steps = 2 if a.quick else a.steps
    torch.set_num_threads(1)
    limit = a.memory_gb * 1e9
    workdir = Path(tempfile.mkdtemp(prefix="memfit."))
    rows = []
    with bench_lock(a.lock):
        for model in a.models.split(","):
            search = Search(model, a.workers, a.memory_gb, a.micro_batches)
            for schedule in a.schedules.split(","):
                for recompute in a.recompute.split(","):
                    size, plan, tried = search.largest(schedule, recompute, a.max_micro_batch)
                    row = {"model": model, "schedule": schedule, "recompute": recompute, "micro_batch_size": size,
                           "micro_batches": a.micro_batches, "batch": size * a.micro_batches, "tried": tried,
                           "capped": size >= a.max_micro_batch, "memory": []}
                    if plan is not None:
                        row["stages"] = [[s.first_node, s.last_node, s.replicas] for s in plan.stages]
                        row["stages_recomputing"] = [s.recompute for s in plan.stages]
                        row["memory"] = verify(plan, steps, workdir, f"{model}-{schedule}-{recompute}")
                    rows.append(row)
                    mem = ", ".join(f"rank {m['rank']} {m['peak_bytes'] / 1e6:.1f}/{m['predicted_bytes'] / 1e6:.1f} MB"
                                    for m in row["memory"])
                    print(f"{model:>12} {schedule:>5} recompute {recompute:>4}: largest batch {row['batch']} "
                          f"({size} x {a.micro_batches}); measured/predicted peak {mem} (limit {limit / 1e6:.0f} MB)",
                          flush=True)
    result = {"benchmark": "memory_fit", "machine": machine(), "command": " ".join(sys.argv),
              "memory_gb": a.memory_gb, "workers": a.workers, "micro_batches": a.micro_batches, "steps": steps,
              "rows": rows}
    json_path, png_path = result_paths("memory_fit", a.quick, a.out_dir)
    write_results(json_path, result, _figure(rows, limit), png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(rows: list[dict], limit: float):
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5))
    names = [f"{r['model']} {r['schedule']} {r['recompute']}" for r in rows]
    x = list(range(len(rows)))
    left.bar(x, [r["batch"] for r in rows], color=[{"none": "C0", "all": "C1", "auto": "C2"}[r["recompute"]]
                                                   for r in rows])
    left.set_xticks(x, names, fontsize=7, rotation=60, ha="right")
    left.set_ylabel("largest batch that fits (samples)")
    left.set_yscale("log")
    peak = [max((m["peak_bytes"] for m in r["memory"]), default=0) / 1e6 for r in rows]
    pred = [max((m["predicted_bytes"] for m in r["memory"]), default=0) / 1e6 for r in rows]
    right.bar([i - 0.2 for i in x], peak, 0.4, label="measured peak (hungriest rank)")
    right.bar([i + 0.2 for i in x], pred, 0.4, label="predicted")
    right.axhline(limit / 1e6, color="k", linestyle="--", linewidth=1, label="--memory-gb")
    right.set_xticks(x, names, fontsize=7, rotation=60, ha="right")
    right.set_ylabel("MB")
    right.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
