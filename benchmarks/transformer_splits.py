"""A transformer with a big vocabulary, split the way torchtitan and Megatron-LM split it, against ``optimal``
(issue 30, item 2).

    python benchmarks/transformer_splits.py --quick                 # predictions at 4 and 8 stages
    python benchmarks/transformer_splits.py --quick --measure 2     # + 2 paired rounds of the 4-stage plans

A Llama-style model (``hf:llama``: Llama-3's 128,256-token vocabulary, untied embedding and LM head,
grouped-query attention) at a tiny width so that it profiles on a CPU: the LM head's matmul over the
vocabulary (and the loss over it) then weighs as much as many layers, the embedding holds most of the
parameters. The model is profiled here (one thread, as each worker runs) and planned on one host of
``--stages`` workers (8 Gbit/s, 500 us: loopback) with 1f1b and 2 micro-batches per worker by:

* ``optimal``: hybridpipe's search (stages and replicas);
* ``uniform``: equal node counts (the existing baseline);
* ``layers``: equal transformer-layer counts, the embedding on the first stage and the head on the last
  (torchtitan's rule with both weights 0);
* ``torchtitan``: its default ``first/last_stage_less_layers`` = 1;
* ``megatron``: ``account_for_embedding/loss_in_pipeline_split`` (the layer count is chosen so that
  L + 2 divides over 4 and 8 stages, as Megatron requires).

Each plan's predicted step (the partitioner's, and the schedule simulator's) is recorded. ``--measure R``
also trains the 4-stage plans on 4 local processes (gloo, one thread each), R rounds, the plans in
ABBA order within each round (a plan identical to an earlier strategy's is run once), and records each
round's measured step over ``optimal``'s: ratios taken side by side, under whatever load the machine has
(recorded: load average before and after).
Writes ``benchmarks/results/transformer_splits[_quick].{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.cost.costmodel import CostModel  # noqa: E402
from hybridpipe.partitioner.plan import Plan, save_plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, build_plan, partition, resolve  # noqa: E402
from hybridpipe.partitioner.search.layersplit import find_stack, stage_node_counts, torchtitan_layers  # noqa: E402
from hybridpipe.partitioner.search.modelcosts import model_costs  # noqa: E402
from hybridpipe.partitioner.search.objective import evaluate  # noqa: E402
from hybridpipe.partitioner.search.strategies import contiguous  # noqa: E402
from hybridpipe.pipeline.simulator import simulate  # noqa: E402
from hybridpipe.profiles.format import Profile  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402
from hybridpipe.runtime.config import build_parser  # noqa: E402
from hybridpipe.runtime.config import resolve as resolve_config  # noqa: E402
from hybridpipe.runtime.worker import run_worker  # noqa: E402

STRATEGIES = ("optimal", "uniform", "layers", "torchtitan", "megatron")


def llama(layers: int, width: int, seq: int) -> str:
    """The zoo spec of a Llama-3-style model at this depth and width with Llama-3's vocabulary."""
    return (f"hf:llama[num_hidden_layers={layers},hidden_size={width},intermediate_size={width * 7 // 2},"
            f"num_attention_heads=4,num_key_value_heads=2,vocab_size=128256,tie_word_embeddings=False,seq={seq}]")


def layer_count_plan(profile: Profile, cluster: Cluster, req: Request) -> Plan:
    """The plan of equal layer counts (torchtitan's rule, weights 0), priced as every strategy is."""
    cluster, workers, opts = resolve(cluster, req)
    model = CostModel(cluster)
    costs = model_costs(profile).slowed(model.compute_slowdown)
    stack = find_stack(costs.names)
    sizes = stage_node_counts(stack, torchtitan_layers(workers, len(stack.layers), 0, 0))
    specs = contiguous(sizes, [1] * workers)
    return build_plan(profile, costs, cluster, specs, evaluate(costs, model, specs, opts), opts, "uniform", model)


def plan_for(strategy: str, profile: Profile, cluster: Cluster, stages: int) -> Plan:
    req = Request(workers=stages, strategy="uniform" if strategy == "layers" else strategy, schedule="1f1b")
    return layer_count_plan(profile, cluster, req) if strategy == "layers" else partition(profile, cluster, req).plan


def describe(plan: Plan, profile: Profile) -> str:
    return " | ".join(f"{profile.nodes[s.first_node].name}..{profile.nodes[s.last_node].name} x{s.replicas}"
                      for s in plan.stages)


def run_plan(rank: int, world: int, plan_path: str, steps: int, run_dir: str) -> dict | None:
    args = build_parser().parse_args(["--plan", plan_path, "--steps", str(steps), "--lr", "0.01", "--seed", "1",
                                      "--run-dir", run_dir, "--no-progress", "--timeout", "300"])
    return run_worker(resolve_config(args, world), print_fn=lambda _: None)


def measure(plans: dict[str, Path], world: int, steps: int, rounds: int, work: Path) -> dict[str, list[float]]:
    """Measured step (ms) of every plan per round, the plans in ABBA order within each round."""
    out: dict[str, list[float]] = {name: [] for name in plans}
    names = list(plans)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            run_dir = work / f"run-{name}-{r}"
            outcomes = run_local(run_plan, world, str(plans[name]), steps, str(run_dir), timeout_s=900,
                                 pg_timeout_s=300)
            problems = describe_failures(outcomes)
            if problems:
                raise RuntimeError(problems)
            step = json.loads((run_dir / "summary.json").read_text())["measured_step_ms"]
            out[name].append(step)
            print(f"round {r} {name}: {step:.0f} ms/step measured", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=14, help="transformer layers (L + 2 must divide by 4 and 8)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--stages", default="4,8")
    p.add_argument("--measure", type=int, default=0, metavar="R", help="rounds of measured runs of the 4-stage plans")
    p.add_argument("--steps", type=int, default=4, help="steps per measured run")
    p.add_argument("--quick", action="store_true", help="profile with 2 repeats")
    p.add_argument("--out-dir")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    torch.set_num_threads(1)
    spec = llama(a.layers, a.width, a.seq)
    profile = profile_model(resolve_model(spec), batch_size=a.batch_size, repeats=2 if a.quick else 5, progress=False)
    heavy = max(profile.nodes, key=lambda n: n.forward_ms + n.backward_ms)
    layer_ms = statistics.median(n.forward_ms + n.backward_ms for n in profile.nodes if ".layers." in n.name)
    print(f"{spec}: {len(profile.nodes)} nodes; heaviest {heavy.name} {heavy.forward_ms + heavy.backward_ms:.1f} ms "
          f"fwd+bwd = {(heavy.forward_ms + heavy.backward_ms) / layer_ms:.0f} median layers ({layer_ms:.2f} ms)")
    work = Path(tempfile.mkdtemp(prefix="transformer_splits."))
    rows: list[dict] = []
    measured_plans: dict[str, Path] = {}
    for stages in (int(s) for s in a.stages.split(",")):
        cluster = Cluster((Level("local", stages, 8.0, 500.0),), 16.0)
        for strategy in STRATEGIES:
            plan = plan_for(strategy, profile, cluster, stages)
            sim = simulate(plan).step_ms + sum(t.predicted_ms for t in plan.tied)
            row = {"stages": stages, "strategy": strategy, "predicted_step_ms": plan.predicted_step_ms,
                   "simulated_step_ms": sim, "pipeline_stages": len(plan.stages),
                   "replicas": [s.replicas for s in plan.stages], "split": describe(plan, profile),
                   "stage_compute_ms": [round(s.compute_ms, 3) for s in plan.stages]}
            rows.append(row)
            print(f"{stages} workers {strategy:>10}: predicted {plan.predicted_step_ms:8.1f} ms, simulated "
                  f"{sim:8.1f} ms; {row['split']}", flush=True)
            same = next((r["strategy"] for r in rows[:-1]
                         if r["stages"] == stages and r["split"] == row["split"]), None)
            if same:
                row["same_plan_as"] = same
            elif stages == 4 and a.measure:                # an identical plan is measured once
                measured_plans[strategy] = save_plan(plan, work / f"{strategy}.json")
    for stages in {r["stages"] for r in rows}:
        base = next(r for r in rows if r["stages"] == stages and r["strategy"] == "optimal")
        for r in rows:
            if r["stages"] == stages:
                r["predicted_vs_optimal"] = r["predicted_step_ms"] / base["predicted_step_ms"]
                r["simulated_vs_optimal"] = r["simulated_step_ms"] / base["simulated_step_ms"]
    result = {"benchmark": "transformer_splits", "machine": machine(), "command": " ".join(sys.argv), "model": spec,
              "batch_size": a.batch_size, "schedule": "1f1b", "micro_batches_per_worker": 2,
              "nodes": [{"name": n.name, "fwd_ms": n.forward_ms, "bwd_ms": n.backward_ms, "param_bytes": n.param_bytes}
                        for n in profile.nodes], "rows": rows, "measured": {}}
    json_path, png_path = result_paths("transformer_splits", a.quick, a.out_dir)
    write_results(json_path, result, _figure(rows), png_path)          # the predictions, before any run
    measured: dict = {}
    if measured_plans:
        load_before = os.getloadavg()
        steps = measure(measured_plans, 4, a.steps, a.measure, work)
        load_after = os.getloadavg()
        ratios = {name: [s / o for s, o in zip(v, steps["optimal"], strict=True)] for name, v in steps.items()}
        measured = {"steps_ms": steps, "ratio_to_optimal_per_round": ratios,
                    "median_ratio_to_optimal": {k: statistics.median(v) for k, v in ratios.items()},
                    "loadavg_before": load_before, "loadavg_after": load_after, "steps_per_run": a.steps}
        for r in rows:
            if r["stages"] == 4:
                name = r.get("same_plan_as", r["strategy"])
                r["measured_step_ms"] = statistics.median(steps[name])
                r["measured_vs_optimal"] = measured["median_ratio_to_optimal"][name]
        print("measured / optimal (median of rounds): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in measured["median_ratio_to_optimal"].items()) +
            f"; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    result["measured"] = measured
    write_results(json_path, result, _figure(rows), png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(rows: list[dict]):
    plt = pyplot()
    groups = sorted({r["stages"] for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for ax, stages in zip(axes[0], groups, strict=True):
        mine = [r for r in rows if r["stages"] == stages]
        x = range(len(mine))
        ax.bar([i - 0.27 for i in x], [r["predicted_step_ms"] for r in mine], 0.27, label="predicted")
        ax.bar(list(x), [r["simulated_step_ms"] for r in mine], 0.27, label="simulated")
        if any("measured_step_ms" in r for r in mine):
            ax.bar([i + 0.27 for i in x], [r.get("measured_step_ms", 0) for r in mine], 0.27, label="measured")
        ax.set_xticks(list(x), [r["strategy"] for r in mine], fontsize=8)
        ax.set_title(f"{stages} workers, 1f1b", fontsize=9)
        ax.set_ylabel("step ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
