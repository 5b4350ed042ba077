"""``hybridpipe partition PROFILE --cluster C.json -o plan.json``: split a model into stages x replicas.

Prints the plan as a table (one row per stage, the bottleneck marked), the predicted step time
and throughput, and how plain data parallelism on the same workers compares; ``--compare``
adds every strategy side by side, ``--layers`` every layer's all-reduce choice.
``--refine RUN_DIR ...`` first corrects the profile and calibration with what those runs measured
(``partitioner/refine/refinement.py``; ``--save-refined DIR`` keeps the corrected files for later plans).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from hybridpipe.argtypes import MAX_TIMEOUT_S, float_range, memory_gb, output_dir, output_file, positive_int
from hybridpipe.commands.refining import (
    describe,
    load_run,
    refine_from_runs,
    refine_terms,
    save_refined,
    simulated_step_ms,
)
from hybridpipe.commands.runnable import runnable
from hybridpipe.commands.show import cluster_line, human_bytes, layer_table, search_line, table
from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory
from hybridpipe.partitioner.cost.calibration import Calibration, load_calibration
from hybridpipe.partitioner.cost.cluster import Cluster, load_cluster
from hybridpipe.partitioner.joint import AUTO_VIRTUAL, MAX_VIRTUAL, joint_partition
from hybridpipe.partitioner.plan import ALGORITHMS, OPTIMIZER_HELP, OPTIMIZERS, PRECISIONS, STRATEGIES, Plan, save_plan
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.partitioner.planner import DEFAULT_TIME_BUDGET_S, Outcome, Request, partition
from hybridpipe.partitioner.refine.refinement import DEFAULT_TERMS, predict_stages
from hybridpipe.partitioner.schedule_registry import AUTO, DEFAULT_SCHEDULE, get_schedule
from hybridpipe.partitioner.search.dp import Progress
from hybridpipe.partitioner.search.objective import StageSpec
from hybridpipe.partitioner.search.options import RECOMPUTE
from hybridpipe.partitioner.search.sharding import SHARD_CHOICES
from hybridpipe.profiles.format import Profile, ProfileNode, inconsistent_times, load_profile
from hybridpipe.profiles.loss_normalization import LOSS_NORMALIZATIONS, check_normalization

SHOW_AFTER_S = 1.0        # the progress bar appears only on partitions that take longer
time_budget = float_range(above=0.0, high=MAX_TIMEOUT_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile JSON written by `hybridpipe profile`")
    parser.add_argument("--cluster", required=True, metavar="C.json",
                        help="cluster description: levels innermost first (see examples/clusters/)")
    parser.add_argument("-o", "--output", type=output_file, metavar="PLAN.json",
                        help="write the plan here (else only print it)")
    parser.add_argument("--workers", type=positive_int, metavar="N", help="use N workers (default: the whole cluster)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="optimal",
                        help="optimal (default), pipedream (PipeDream's formula), dp (data parallel), "
                             "uniform (equal node counts), params (balanced parameters), time (balanced compute), "
                             "torchtitan (transformer layers counted out, the embedding and the output weighing a "
                             "layer each: first/last_stage_less_layers 1), megatron (Megatron-LM's "
                             "account_for_embedding/loss_in_pipeline_split: L + 2 layers split evenly)")
    add_schedule_option(parser, default=DEFAULT_SCHEDULE, auto=True)
    parser.add_argument("--virtual-stages", type=virtual_stages, metavar="V|auto",
                        help="model chunks per worker: V > 1 with --schedule interleaved-1f1b, zbv (V = 2) "
                             "or auto; a baseline strategy's stage groups and replicas each hold V chunks, optimal "
                             "searches the groups with them; the fill and drain shrink by V. auto (the default with "
                             f"--schedule auto, else 1): searched with the schedule, V = 1..{MAX_VIRTUAL}, "
                             "compared by simulation")
    parser.add_argument("--recompute", choices=RECOMPUTE, default="none",
                        help="activation recomputation: none (default), all stages, or auto (the stages that "
                             "would not fit in --memory-gb otherwise; the extra forward is charged)")
    parser.add_argument("--shard", choices=SHARD_CHOICES, default="none",
                        help="what a stage's replicas shard (ZeRO): none (default: each holds everything), optimizer "
                             "(ZeRO-1), gradients (ZeRO-2), parameters (ZeRO-3, gathered per micro-batch or kept for "
                             "the step, as the plan chooses), or auto (per stage, the fastest level that fits)")
    parser.add_argument("--precision", choices=(*PRECISIONS, AUTO), default="fp32",
                        help="what the job will run in (launch --precision; default fp32): activations cross in "
                             "the dtype autocast computed them in, as a profile taken with --precision measured them "
                             "(an fp32 profile's are priced at half the bytes under bf16/fp16, an estimate); auto: "
                             "the faster predicted of fp32 and bf16, searched with the schedule")
    parser.add_argument("--reduce-dtype", choices=PRECISIONS, default="fp32",
                        help="what a stage's replicas sum their gradients in (launch --reduce-dtype; default fp32): "
                             "bf16/fp16 price the all-reduces at half the bytes")
    parser.add_argument("--loss-normalization", choices=LOSS_NORMALIZATIONS, default="micro-batch",
                        help="recorded for launch (which may override it): micro-batch (default), a step's loss is "
                             "the mean of its micro-batches' mean losses; tokens, the step's summed per-token loss "
                             "over its valid tokens in all micro-batches and replicas, as one process on the whole "
                             "global batch (flushed schedules only)")
    add_micro_batches_option(parser, default="2 per worker")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="optimizer state kept per weight: sgd momentum 1x, adam and adamw 2x (default sgd; "
                             f"{OPTIMIZER_HELP})")
    parser.add_argument("--memory-gb", type=memory_gb, metavar="X",
                        help="memory per worker (default: the cluster's)")
    parser.add_argument("--calibration", action="append", default=[], metavar="CAL.json",
                        help="measured costs from `hybridpipe bench-allreduce` (one per cluster level; repeatable)")
    parser.add_argument("--stages", type=positive_int, metavar="S",
                        help="uniform/params/torchtitan/megatron: S stages of workers/S replicas")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), metavar="A,B",
                        help=f"all-reduce algorithms the hybrid policy may pick (default {','.join(ALGORITHMS)})")
    parser.add_argument("--aggregator", choices=("worker", "dedicated"), default="worker",
                        help="aggregator all-reduce on a worker rank or a dedicated process (default worker)")
    parser.add_argument("--layers", action="store_true", help="also print every layer's all-reduce choice")
    parser.add_argument("--compare", action="store_true", help="also predict every other strategy")
    parser.add_argument("--refine", nargs="+", default=[], metavar="RUN_DIR",
                        help="correct the profile and calibration with what these runs (--run-dir of launch, "
                             "with their timelines) measured before planning; every strategy uses the corrections")
    parser.add_argument("--refine-terms", type=refine_terms, default=None, metavar="T,T|none",
                        help="with --refine: the stage terms fitted beside the node factors: replicas (a replicated "
                             "stage's compute stretch per replica count), accumulation (gradient accumulation per "
                             "parameter byte); default both, none for neither (benchmarks/RESULTS.md 4e)")
    parser.add_argument("--save-refined", type=output_dir, metavar="DIR",
                        help="with --refine: write the refined profile.json and calibration.json here (a later "
                             "partition of any model on this cluster can take the calibration)")
    parser.add_argument("--time-budget", "--time-limit", type=time_budget, default=DEFAULT_TIME_BUDGET_S, metavar="S",
                        help=f"stop searching after S seconds (default {DEFAULT_TIME_BUDGET_S:g}): optimal keeps the "
                             "best plan found so far and prints (and records in the plan) how far from the optimum it "
                             "can be; the other strategies stop with one line")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.schedule != AUTO:           # auto picks among flushed schedules only
        check_normalization(args.loss_normalization, get_schedule(args.schedule).flushed, args.schedule)
    profile = load_profile(args.profile)
    cluster = load_cluster(args.cluster)
    calibrations = [load_calibration(p) for p in args.calibration]
    check_search_size(len(profile.nodes), args.workers or cluster.total_workers)
    if args.save_refined and not args.refine:
        raise UserError("--save-refined writes what --refine learnt; add --refine RUN_DIR")
    if args.refine_terms is not None and not args.refine:
        raise UserError("--refine-terms says what --refine fits; add --refine RUN_DIR")
    if args.refine:
        # a run named twice (runs/* holds runs/latest, a link to the last run) is one run
        runs = [load_run(d) for d in dict.fromkeys(Path(d).resolve() for d in args.refine)]
        terms = DEFAULT_TERMS if args.refine_terms is None else args.refine_terms
        refined = refine_from_runs(profile, cluster, calibrations, runs, terms=terms)
        print(describe(refined, profile, cluster, calibrations, runs) + "\n")
        profile, calibrations = refined.profile, list(refined.calibrations)
        if args.save_refined:
            print("wrote " + ", ".join(map(str, save_refined(refined, args.save_refined))) + "\n")
    req = Request(workers=args.workers, strategy=args.strategy, schedule=args.schedule,
                  micro_batches=args.micro_batches, optimizer=args.optimizer, memory_gb=args.memory_gb,
                  stages=args.stages, algorithms=tuple(a.strip() for a in args.algorithms.split(",") if a.strip()),
                  dedicated_aggregator=args.aggregator == "dedicated", time_budget_s=args.time_budget,
                  recompute=args.recompute, precision=args.precision, reduce_dtype=args.reduce_dtype,
                  virtual_stages=(AUTO_VIRTUAL if args.schedule == AUTO else 1) if args.virtual_stages is None
                  else args.virtual_stages, shard=args.shard)

    def search(r: Request) -> Outcome:
        with search_bar(args.strategy, disable=args.quiet) as progress:
            return joint_partition(profile, cluster, r, calibrations, progress=progress,
                                   simulate=simulated_step).outcome
    outcome = runnable(search, req)
    req = chosen_request(req, outcome.plan)
    print(render(outcome, profile.nodes, layers=args.layers))
    for note in outcome.notes:
        print(f"note: {note}")
    critical = refined_step_note(outcome.plan, profile, cluster, calibrations) if args.refine else None
    if critical:
        print(f"note: {critical}")
    busy = inconsistent_times(profile.totals.ratio, profile.threads)
    if busy:
        print(f"note: the profile's {busy}")
    print(compare(profile, cluster, req, calibrations, outcome, every=args.compare))
    if args.output:
        save_plan(dataclasses.replace(outcome.plan, loss_normalization=args.loss_normalization), Path(args.output))
        print(f"wrote {args.output}")
    else:
        print("(not saved: pass -o plan.json to write the plan)")
    return 0


def refined_step_note(plan: Plan, profile: Profile, cluster: Cluster,
                      calibrations: Sequence[Calibration]) -> str | None:
    """What the refined model predicts for ``plan`` by the schedule's critical path, the step model
    --refine fitted its leftover terms under (the search and the plan's ``predicted_step_ms`` use the
    closed form, which the partitioner computes without the simulator); None where that model does not
    price the plan: several chunks a rank, sharded replicas, recomputation, 16-bit wire, pipedream."""
    if (plan.virtual_stages != 1 or not plan.kind.flushed or plan.precision != "fp32" or plan.reduce_dtype != "fp32"
            or any(s.shard != "none" or s.recompute for s in plan.stages)):
        return None
    stages = [StageSpec(s.first_node, s.last_node, s.ranks) for s in plan.stages]
    step_ms = predict_stages(profile, cluster, calibrations, stages, plan.schedule, plan.micro_batches, plan.optimizer,
                             step=simulated_step_ms)
    return (f"by the schedule's critical path, the step model --refine fitted under, this plan takes {step_ms:.1f} ms "
            f"a step (the search's closed form, which the plan records: {plan.predicted_step_ms:.1f} ms)")


# the optimal strategy's peak memory, measured by benchmarks/partitioner_speed.py (RESULTS.md): its
# all-reduce price tables grow with workers squared (2.1 GB at 4096), its stage tables with nodes
# squared (150 MB at 1000 nodes); about 128 bytes per entry of either, rounded up
DP_BYTES_PER_ENTRY = 160


def simulated_step(plan: Plan) -> float:
    """The plan's step as the schedule simulator predicts it (ms): plans with virtual stages."""
    from hybridpipe.pipeline.simulator import simulate  # here: the pipeline package imports torch

    return simulate(plan).step_ms


def check_search_size(nodes: int, workers: int) -> None:
    """UserError before any work unless the partitioner's tables for ``nodes`` x ``workers`` fit."""
    require_memory(DP_BYTES_PER_ENTRY * (nodes * nodes + workers * workers),
                   f"partitioning {nodes} nodes over {workers:,} workers",
                   "plan for fewer workers (--workers N) or profile the model at a coarser granularity")


@contextlib.contextmanager
def search_bar(strategy: str, disable: bool = False) -> Iterator[Callable[[Progress], None] | None]:
    """A tqdm bar on stderr for a search that takes more than a second: its bounds on the optimum as it goes."""
    if disable or strategy != "optimal":
        yield None
        return
    bar = tqdm(desc="optimal", unit=" stages", unit_scale=True, delay=SHOW_AFTER_S, file=sys.stderr, leave=False)
    start = time.monotonic()
    shown = start - 1.0

    def update(p: Progress) -> None:
        nonlocal shown
        now = time.monotonic()
        if now - start < SHOW_AFTER_S or now - shown < 0.2:       # quick partitions show nothing
            return
        shown = now
        bar.n = p.candidates
        best = f"{p.best_ms:.1f}" if math.isfinite(p.best_ms) else "-"
        bar.set_postfix_str(f"{p.phase}: optimum in [{p.lower_ms:.1f}, {best}] ms/step", refresh=False)
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def render(outcome: Outcome, nodes: Sequence[ProfileNode], *, layers: bool = False) -> str:
    """The plan for people: header, one row per stage (bottleneck marked), prediction."""
    plan, ev = outcome.plan, outcome.evaluation
    worst = max(range(len(ev.stages)), key=lambda k: ev.stages[k].term_ms)
    head = [f"plan for {plan.model}: global batch {plan.micro_batches * plan.batch_size} = {plan.micro_batches} "
            f"micro-batches x {plan.batch_size} samples per step, "
            f"schedule {plan.schedule}" + (f" ({plan.virtual_stages} chunks per worker)" if plan.virtual_stages > 1
                                           else "") + f", strategy {plan.strategy}, optimizer {plan.optimizer}",
            f"cluster: {cluster_line(plan.cluster, outcome.options.memory_bytes / 1e9)}; {plan.world_size} workers"]
    rows = []
    sharded = any(s.shard != "none" for s in plan.stages)
    for s, e in zip(plan.stages, ev.stages, strict=True):
        algos = Counter(lv.algorithm for lv in s.layers)
        load = f"{100 * e.term_ms / ev.objective_ms:.0f}%" + (" *" if s.index == worst else "")
        rows.append([s.index, f"{s.first_node}-{s.last_node}", f"{nodes[s.first_node].name}..{nodes[s.last_node].name}",
                     s.replicas, rank_ranges(s.ranks), f"{s.forward_ms:.2f}", f"{s.backward_ms:.2f}",
                     f"{s.sync_ms:.2f}", f"{s.overhead_ms:.2f}", human_bytes(s.send_bytes) if s.send_bytes else "-",
                     human_bytes(s.memory_bytes) + (" rc" if s.recompute else ""), load,
                     ", ".join(f"{a} x{c}" for a, c in sorted(algos.items())) or "-"]
                    + ([shard_label(s.shard, s.reshard_after_forward)] if sharded else []))
    body = table(["stage", "nodes", "layers", "replicas", "ranks", "fwd ms", "bwd ms", "sync ms", "extra ms",
                  "sends", "memory", "load", "all-reduce"] + (["shard"] if sharded else []), rows)
    foot = [f"predicted step {plan.predicted_step_ms:.1f} ms = {plan.predicted_samples_per_s:.1f} samples/s "
            f"(steady state {ev.objective_ms:.1f} ms/step, bound by stage {worst}, marked *)",
            "fwd/bwd: one micro-batch; sync: exposed all-reduce per step; extra: optimizer steps and compute lost "
            "to communication per step"
            + ("; shard: ZeRO level of a stage's replicas (sync: its reduce-scatters and all-gathers, with those "
               "exposed inside the step)" if sharded else "")] + ([search_line(plan.search)] if plan.search else [])
    out = head + ["", body, ""] + foot
    if layers:
        out += ["", layer_table(plan)]
    return "\n".join(out)


def virtual_stages(text: str) -> int:
    """``--virtual-stages``: a whole number >= 1, or ``auto`` (searched: AUTO_VIRTUAL)."""
    return AUTO_VIRTUAL if text == AUTO else positive_int(text)


def chosen_request(req: Request, plan: Plan) -> Request:
    """The request with what the joint search chose in place of what it left open (for --compare)."""
    if req.virtual_stages != AUTO_VIRTUAL and req.precision != AUTO:
        return req
    return dataclasses.replace(req, virtual_stages=plan.virtual_stages, precision=plan.precision,
                               schedule=plan.schedule if plan.virtual_stages > 1 else req.schedule)


def compare(profile: Profile, cluster: Cluster, req: Request, calibrations: Sequence[Calibration], outcome: Outcome,
            *, every: bool) -> str:
    """One line against data parallelism, or (``every``) a table of all strategies."""
    mine = outcome.plan.predicted_step_ms
    names = [s for s in STRATEGIES if s != req.strategy] if every else (["dp"] if req.strategy != "dp" else [])
    rows: list[list[object]] = []
    reasons: list[str] = []
    for name in names:
        try:
            other = partition(profile, cluster, Request(**{**req.__dict__, "strategy": name, "stages": None}),
                              calibrations, simulate=simulated_step).plan
        except UserError as e:
            rows.append([name, "-", "-", "-", "infeasible (why: below)"])
            reasons.append(f"{name} is infeasible: {e}")
            continue
        rows.append([name, len(other.stages), f"{other.predicted_step_ms:.1f}", f"{other.predicted_samples_per_s:.1f}",
                     f"{other.predicted_step_ms / mine:.2f}x the step of {req.strategy}"])
    if every and req.strategy == "optimal":
        rows += shard_rows(profile, cluster, req, calibrations, outcome.plan, reasons)
    if not rows:
        return ""
    if not every:
        r = rows[0]
        return (f"data parallel on the same workers: {r[2]} ms/step ({r[4]})" if r[1] != "-"
                else f"data parallel on the same workers: infeasible: {reasons[0].split(': ', 1)[1]}")

    out = "\n" + table(["strategy", "stages", "step ms", "samples/s", "vs this plan"], rows)
    return out + "".join(f"\n{reason}" for reason in reasons)


def shard_label(shard: str, reshard: bool) -> str:
    """A stage's shard level for people: ZeRO-1/2/3 (ZeRO-3 kept: gathered once per step)."""
    if shard == "none":
        return "-"
    zero = {"optimizer": 1, "gradients": 2, "parameters": 3}[shard]
    return f"ZeRO-{zero}" + ("" if shard != "parameters" or reshard else " kept")


def shard_rows(profile: Profile, cluster: Cluster, req: Request, calibrations: Sequence[Calibration], this: Plan,
               reasons: list[str]) -> list[list[object]]:
    """The optimal plan at every other --shard choice, then the best replicated and the best sharded of them
    all (this plan included; a plan counts as sharded when a stage of it shards)."""
    mine = this.predicted_step_ms
    rows: list[list[object]] = []
    best: dict[bool, tuple[float, str]] = {}
    for choice in SHARD_CHOICES:
        label = f"optimal --shard {choice}"
        try:
            plan = (partition(profile, cluster, dataclasses.replace(req, shard=choice), calibrations,
                              simulate=simulated_step).plan if choice != req.shard else None)
        except UserError as e:
            rows.append([label, "-", "-", "-", "infeasible (why: below)"])
            reasons.append(f"{label} is infeasible: {e}")
            continue
        step = mine if plan is None else plan.predicted_step_ms
        if plan is not None:
            rows.append([label, len(plan.stages), f"{step:.1f}", f"{plan.predicted_samples_per_s:.1f}",
                         f"{step / mine:.2f}x the step of this plan"])
        is_sharded = any(s.shard != "none" for s in (plan if plan is not None else this).stages)
        if is_sharded not in best or step < best[is_sharded][0]:
            best[is_sharded] = (step, label if plan is not None else f"{label} (this plan)")
    for key, name in ((False, "best replicated"), (True, "best sharded")):
        if key in best:
            rows.append([name, "", f"{best[key][0]:.1f}", "", best[key][1]])
    return rows


def rank_ranges(ranks: Iterable[int]) -> str:
    """Sorted ranks as compact ranges: 0-3,8-11."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
