"""The joint search (schedule x virtual stages x precision with the stages and their groups) against the best
of the separate searches it replaces (issue 30, item 1): predicted steps, no runs.

    python benchmarks/joint_search.py --quick

Separate (before): the stages and replicas searched for one chunk per worker (``--schedule auto``: gpipe,
1f1b, zb-h1), and for each V = 2..4 the 1F1B search's groups cut into V chunks per worker
(interleaved-1f1b, zbv) as ``--virtual-stages V`` made them; the user's best pick of those runs is their
minimum. Joint: ``partition --schedule auto`` with V unasked (``partition/joint.py``), the groups
searched with the chunks; and with ``--precision auto`` also bf16 (a column apart: it changes the
numerics). Every step is the schedule simulator's (plus tied sums and the per-step overhead), fp32 unless
said, 2 micro-batches per worker, on one network level of ``--gbps`` (1 Gbit/s as
``examples/clusters/{4,8}x1gbit.json``, and 0.1 Gbit/s, where gradient sums cost more than pipelines do).
Writes ``benchmarks/results/joint_search[_quick].{json,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from benchmarks.transformer_splits import llama  # noqa: E402
from hybridpipe.errors import UserError  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.joint import AUTO_VIRTUAL, joint_partition  # noqa: E402
from hybridpipe.partitioner.plan import Plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, build_plan, partition, simulated_ms  # noqa: E402
from hybridpipe.partitioner.schedule_registry import REGISTRY  # noqa: E402
from hybridpipe.partitioner.search.modelcosts import model_costs  # noqa: E402
from hybridpipe.partitioner.search.virtual import virtual_plan  # noqa: E402
from hybridpipe.pipeline.simulator import simulate  # noqa: E402
from hybridpipe.profiles.format import Profile  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402

# name -> (zoo spec, samples per micro-batch)
MODELS = {
    "mlp": ("mlp[hidden=512]", 32),
    "gpt": ("gpt", 8),
    "alexnet": ("alexnet[image=64]", 32),
    "llama-128k": (llama(14, 64, 32), 2),
}


def step_of(plan: Plan) -> float:
    return simulate(plan).step_ms


def separate(profile: Profile, cluster: Cluster, req: Request) -> tuple[float, str]:
    """The best of the separate searches (module docstring): (simulated step, what it was)."""
    one = partition(profile, cluster, dataclasses.replace(req, schedule="auto", virtual_stages=1))
    best = (simulated_ms(one, step_of), f"{one.plan.schedule} V=1")
    base = partition(profile, cluster, dataclasses.replace(req, schedule="1f1b", virtual_stages=1))
    costs = model_costs(profile).slowed(base.model.compute_slowdown)
    groups = [tuple(s.ranks) for s in base.plan.stages]

    def build(specs, ev, o):
        return build_plan(profile, costs, base.plan.cluster, specs, ev, o, req.strategy, base.model)
    for name, kind in REGISTRY.items():
        for virtual in (2, 3, 4):
            if not (kind.flushed and kind.chunked and kind.virtual_ok(virtual)):
                continue
            opts = dataclasses.replace(base.options, schedule=kind)
            try:
                _, ev = virtual_plan(groups, costs, base.model, opts, virtual, build, step_of)
            except UserError:
                continue
            if ev.objective_ms < best[0]:
                best = (ev.objective_ms, f"{name} V={virtual}")
    return best


def describe(plan: Plan) -> str:
    groups = len({s.ranks for s in plan.stages})
    return (f"{plan.schedule} V={plan.virtual_stages} {plan.precision}, {groups} groups "
            f"({'/'.join(str(len(s.ranks)) for s in plan.stages[:groups])} replicas)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--workers", default="4,8")
    p.add_argument("--gbps", default="1,0.1", help="network bandwidths (Gbit/s, 50 us latency)")
    p.add_argument("--quick", action="store_true", help="profile with 2 repeats")
    p.add_argument("--out-dir")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    torch.set_num_threads(1)
    rows = []
    for name in a.models.split(","):
        spec, batch = MODELS[name]
        profile = profile_model(resolve_model(spec), batch_size=batch, repeats=2 if a.quick else 5, progress=False)
        for workers, gbps in itertools.product((int(w) for w in a.workers.split(",")),
                                               [float(g) for g in a.gbps.split(",")]):
            cluster = Cluster((Level("network", workers, gbps, 50.0),), 16.0)
            req = Request(schedule="auto")
            start = time.process_time()
            sep_ms, sep_what = separate(profile, cluster, req)
            sep_s = time.process_time() - start
            start = time.process_time()
            joint = joint_partition(profile, cluster, dataclasses.replace(req, virtual_stages=AUTO_VIRTUAL),
                                    simulate=step_of)
            joint_s = time.process_time() - start
            mixed = joint_partition(profile, cluster, dataclasses.replace(req, virtual_stages=AUTO_VIRTUAL,
                                                                          precision="auto"), simulate=step_of)
            joint_ms = min(t.step_ms for t in joint.tried if t.step_ms is not None)
            mixed_ms = min(t.step_ms for t in mixed.tried if t.step_ms is not None)
            row = {"model": name, "spec": spec, "batch_size": batch, "workers": workers, "gbps": gbps,
                   "nodes": len(profile.nodes),
                   "separate_ms": sep_ms, "separate_choice": sep_what, "separate_cpu_s": sep_s,
                   "joint_ms": joint_ms, "joint_choice": describe(joint.outcome.plan), "joint_cpu_s": joint_s,
                   "joint_vs_separate": joint_ms / sep_ms,
                   "joint_precision_auto_ms": mixed_ms, "joint_precision_auto_choice": describe(mixed.outcome.plan),
                   "tried": [{"schedule": t.choice.schedule, "virtual": t.choice.virtual,
                              "precision": t.choice.precision, "step_ms": t.step_ms, "why": t.why}
                             for t in joint.tried]}
            rows.append(row)
            print(f"{name:>10} on {workers} at {gbps:g} Gbit/s: separate {sep_ms:9.1f} ms ({sep_what}), "
                  f"joint {joint_ms:9.1f} ms "
                  f"({row['joint_choice']}) = {row['joint_vs_separate']:.3f}x in {joint_s:.1f} s CPU; with bf16 "
                  f"allowed {mixed_ms:9.1f} ms ({row['joint_precision_auto_choice']})", flush=True)
            result = {"benchmark": "joint_search", "machine": machine(), "command": " ".join(sys.argv), "rows": rows}
            json_path, png_path = result_paths("joint_search", a.quick, a.out_dir)
            write_results(json_path, result, _figure(rows), png_path)       # after every row: a stopped run keeps them
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(rows: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [1.0] * len(rows), 0.27, label="best of the separate searches")
    ax.bar(list(x), [r["joint_vs_separate"] for r in rows], 0.27, label="joint (fp32)")
    ax.bar([i + 0.27 for i in x], [r["joint_precision_auto_ms"] / r["separate_ms"] for r in rows], 0.27,
           label="joint, bf16 allowed")
    ax.set_xticks(list(x), [f"{r['model']}\n{r['workers']}x{r['gbps']:g}G" for r in rows], fontsize=6)
    ax.set_ylabel("predicted step / separate's")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
