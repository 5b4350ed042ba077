"""Prediction error after refinement, leave-one-plan-out, and the noise floor, over every traced run of a
``benchmarks/plans.py --trace --work DIR`` (issue 30 items 3 and 4).

    python benchmarks/plans_prediction.py --work /tmp/measure-bench \
        --results benchmarks/results/plans_measured_quick.json

For each model x hosts group of the results, every run directory that ``plans.py`` left in ``--work`` with
a summary and its timelines (the strategies' runs ``run-*``, autotune's ``autotune-*/runs/run-*``, the
paired rounds ``pairs-*/pair-*``) is read as refinement reads it. Runs of the same plan (same stages, ranks,
schedule, micro-batches and per-layer all-reduce) form one plan; its measurement is the median of every
steady step of all its runs (pooled; steady: after the summary's warm-up and the leading steps still warming
up, ``observed.settling_steps``).

* **Noise floor**: a plan run more than once, each run's median against every other run's of the same
  plan, |m_i / m_j - 1| (the same plan rerun, minutes apart on the shared machine).
* **Before refinement**: the plan's own prediction (the group's calibrated profile and all-reduce
  calibration, as ``plans.py`` planned it). **model**: the same, unrefined, by this code's cost model
  (differs from ``before`` where the runs were planned by an older one).
* **In-sample**: refined from every run of the group (as ``hybridpipe partition --refine`` would), each
  plan re-predicted.
* **Leave-one-plan-out** (the honest figure for a plan not yet run): for each plan, refined from the runs
  of the group's *other* plans only (none of its own reruns), then predicted.

Error = |predicted - measured| / measured. Writes ``benchmarks/results/<name>_prediction.{json,png}``: the
figure is predicted (leave-one-out) vs measured step of every run, with the 3% band.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridpipe.argtypes import float_range
from hybridpipe.errors import UserError, one_line
from hybridpipe.partitioner.refine.observed import RunObservation
from hybridpipe.partitioner.refine.refinement import DEFAULT_TERMS

GOAL = 0.03        # the median |error|
WORST = 0.10       # and worst


def shrink_strength(text: str) -> str | float:
    """``--node-shrink``: ``cv``, or a finite strength >= 0 (nan, negative and huge values refused)."""
    return text if text == "cv" else float_range(0.0, 1e6)(text)


def term_list(text: str) -> tuple[str, ...]:
    """``--terms``: comma-separated names of ``refinement.TERMS`` (empty or ``none``: none)."""
    from hybridpipe.partitioner.refine.refinement import TERMS
    names = tuple(t for t in text.split(",") if t and t != "none")
    if any(t not in TERMS for t in names):
        raise argparse.ArgumentTypeError(f"terms are {', '.join(TERMS)}; got {text!r}")
    return names


def plan_of(run: RunObservation) -> tuple:
    """What the runtime ran: schedule, micro-batches, every stage's nodes, ranks and all-reduces."""
    return (run.schedule, run.micro_batches,
            tuple((s.first, s.last, tuple(s.ranks), tuple(sorted(s.algorithms.items()))) for s in run.stages))


def layout(run: RunObservation) -> str:
    return " | ".join(f"{s.first}-{s.last}x{len(s.ranks)}" if s.first != s.last else f"{s.first}x{len(s.ranks)}"
                      for s in run.stages)


def run_median(run: RunObservation) -> float:
    """A run's median steady step (its summary's measured step when the steps are unknown)."""
    if run.step_times_ms:
        return statistics.median(run.step_times_ms)
    assert run.measured_step_ms is not None
    return run.measured_step_ms


def pooled_ms(runs: Sequence[RunObservation]) -> float:
    """The median of every steady step of ``runs`` (each run's median where its steps are unknown)."""
    steps = [t for r in runs for t in (r.step_times_ms or (run_median(r),))]
    return statistics.median(steps)


def group_plans(runs: Sequence[RunObservation]) -> dict[tuple, list[RunObservation]]:
    """The runs that measured a step, by plan (first seen first)."""
    out: dict[tuple, list[RunObservation]] = {}
    for r in runs:
        if r.measured_step_ms:
            out.setdefault(plan_of(r), []).append(r)
    return out


def rerun_spreads(plans: Mapping[tuple, Sequence[RunObservation]]) -> list[float]:
    """|m_i / m_j - 1| for every pair of runs of the same plan (the noise floor)."""
    return [abs(run_median(a) / run_median(b) - 1) for runs in plans.values()
            for a, b in itertools.combinations(runs, 2)]


# refine(training runs) -> predict(run) -> ms: a model refined from the runs given, predicting a run's step
Refiner = Callable[[Sequence[RunObservation]], Callable[[RunObservation], float]]


@dataclass(frozen=True)
class PlanError:
    """One plan of a group: its runs, pooled measurement and the three predictions."""

    layout: str
    runs: tuple[str, ...]
    run_ms: tuple[float, ...]
    measured_ms: float
    before_ms: float | None          # the plan's own prediction (None: no run recorded it)
    in_sample_ms: float
    leave_one_out_ms: float
    model_ms: float | None = None    # unrefined, the current cost model on the group's profile and calibration

    def error(self, predicted: float | None) -> float | None:
        return None if predicted is None else abs(predicted - self.measured_ms) / self.measured_ms


def plan_errors(runs: Sequence[RunObservation], refiner: Refiner,
                unrefined: Callable[[RunObservation], float] | None = None) -> list[PlanError]:
    """Every plan of a group's ``runs`` with its predictions before, in-sample and leave-one-plan-out
    (and ``unrefined``'s: the current model's before refinement, where the runs recorded an older one's)."""
    plans = group_plans(runs)
    everything = [r for rs in plans.values() for r in rs]
    all_in = refiner(everything)
    out = []
    for key, mine in plans.items():
        others = [r for k, rs in plans.items() if k != key for r in rs]
        held = refiner(others) if others else None
        before = next((r.predicted_step_ms for r in mine if r.predicted_step_ms), None)
        out.append(PlanError(layout(mine[0]), tuple(r.name for r in mine), tuple(float(run_median(r)) for r in mine),
                             float(pooled_ms(mine)), before, all_in(mine[0]), held(mine[0]) if held else float("nan"),
                             unrefined(mine[0]) if unrefined else None))
    return out


def compute_factors(run: RunObservation, forward_ms: Sequence[float], backward_ms: Sequence[float]) -> list[float]:
    """Per stage of ``run``: its measured forward + backward of one micro-batch over the (calibrated) profile's
    for its nodes: how fast the hosts computed in this plan against the speed the plans were made with."""
    out = []
    for s in run.stages:
        profiled = sum(forward_ms[s.first:s.last + 1]) + sum(backward_ms[s.first:s.last + 1])
        if s.forward_ms is not None and s.backward_ms is not None and profiled > 0:
            out.append(round((s.forward_ms + s.backward_ms) / profiled, 3))
    return out


def summarize(errors: Sequence[float | None]) -> dict:
    """Median and worst |error| and how many are within GOAL / WORST."""
    e = sorted(x for x in errors if x is not None and x == x)
    if not e:
        return {"plans": 0}
    return {"plans": len(e), "median": statistics.median(e), "worst": e[-1], "within_3pct": sum(x <= GOAL for x in e),
            "within_10pct": sum(x <= WORST for x in e)}


# ---- the files (plans.py's work folder) ------------------------------------------------------

def run_dirs(work: Path, model: str, hosts: int) -> list[Path]:
    """Every run directory plans.py left for a group, with a summary and timelines, in the order they ran."""
    found = [*work.glob(f"run-{model}-{hosts}-*"), *work.glob(f"autotune-{model}-{hosts}/runs/run-*"),
             *work.glob(f"pairs-{model}-{hosts}/pair-*")]
    return sorted((d for d in found if d.is_dir() and (d / "summary.json").is_file()),
                  key=lambda d: (d / "summary.json").stat().st_mtime)


def group_refiner(profile_path: Path, cluster_path: Path, calibration_paths: Sequence[Path],
                  node_shrink: float | None = 0.0, terms: Sequence[str] = DEFAULT_TERMS,
                  step_loss: bool = True, step: str = "simulated") -> Refiner:
    """refine (as refine_from_runs does, with ``node_shrink``, ``terms`` and ``step_loss``: refinement.refine)
    on the group's calibrated profile and calibration; predict_run with the result. ``step``: the step model
    (``simulated``: the schedule's critical path, ``simulator.predicted_step_ms``, refine_from_runs' default;
    ``formula``: ``objective.predict_step_ms``'s closed form)."""
    from hybridpipe.partitioner.cost.calibration import load_calibration
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.refine.refinement import predict_run, refine, refined_calibrations, refined_profile
    from hybridpipe.partitioner.search.objective import formula_step_ms
    from hybridpipe.pipeline.simulator import predicted_step_ms
    from hybridpipe.profiles.format import load_profile
    model = {"simulated": predicted_step_ms, "formula": formula_step_ms}[step]
    profile, cluster = load_profile(profile_path), load_cluster(cluster_path)
    cals = [load_calibration(c) for c in calibration_paths]

    def refiner(runs: Sequence[RunObservation]) -> Callable[[RunObservation], float]:
        if not runs:                                    # nothing to refine from: the model as calibrated
            return lambda run: float(predict_run(profile, cluster, cals, run, step=model))
        ref = refine(profile, cluster, cals, runs, node_shrink=node_shrink, terms=terms, step_loss=step_loss,
                     step=model)
        prof, refined = refined_profile(profile, ref), refined_calibrations(cluster, cals, ref)
        return lambda run: float(predict_run(prof, cluster, refined, run, step=model))
    return refiner


def plot(plt, groups: Mapping[str, Sequence[PlanError]], title: str):
    """Predicted (leave-one-plan-out) vs measured step of every run (small) and plan (pooled, large), 3% band."""
    fig, ax = plt.subplots(figsize=(7, 6))
    values = []
    for (name, plans), colour in zip(groups.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red"),
                                     strict=False):
        for k, p in enumerate(plans):
            x = p.leave_one_out_ms / 1e3
            ax.scatter([x] * len(p.run_ms), [m / 1e3 for m in p.run_ms], s=12, color=colour, alpha=0.5)
            ax.scatter([x], [p.measured_ms / 1e3], s=60, color=colour, edgecolors="k",
                       label=f"{name}: plan (pooled steps)" if k == 0 else None)
            if p.before_ms:
                ax.scatter([p.before_ms / 1e3], [p.measured_ms / 1e3], s=40, facecolors="none", edgecolors=colour,
                           label=f"{name}: before refinement" if k == 0 else None)
            values += [x, p.measured_ms / 1e3, *(m / 1e3 for m in p.run_ms)]
    lo, hi = min(values) * 0.85, max(values) * 1.15
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo * (1 - GOAL), hi * (1 - GOAL)], [lo * (1 + GOAL), hi * (1 + GOAL)], color="green",
                    alpha=0.25, label="within 3%")
    ax.plot([lo, hi], [lo * (1 + WORST), hi * (1 + WORST)], "k:", lw=0.7, label="10%")
    ax.plot([lo, hi], [lo * (1 - WORST), hi * (1 - WORST)], "k:", lw=0.7)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step (s): leave-one-plan-out (filled), before refinement (hollow)", fontsize=8)
    ax.set_ylabel("measured step (s): each run (small), the plan pooled (large)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return fig


def paired_view(row: Mapping) -> dict:
    """Issue 30 item 3 from a plans.py autotune row: its paired comparison (plans_autotune.paired_comparison).
    ``vs``: autotune's step / the other plan's (< 1: autotune's plan is faster); its speed-up is the inverse."""
    pair = row["autotune"]["paired"]
    return {"group": f"{row['model']}, {row['hosts']} hosts", "chosen": row.get("layout"),
            "rounds": pair.get("rounds"), "vs": pair.get("vs") or {"fastest": pair.get("ratio")},
            "median_ms": pair.get("median_ms"), "same_as": pair.get("same_as"),
            "round_medians_ms": pair.get("round_medians_ms"), "rerun_spread": pair.get("rerun_spread")}


def main(argv: Sequence[str] | None = None) -> int:
    """The command; a missing or malformed input file is one line on stderr and exit 2."""
    try:
        return _main(argv)
    except UserError as e:
        print(f"plans_prediction: error: {one_line(e)}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    from benchmarks.common import REPO, machine, pyplot, write_results
    from hybridpipe.commands.refining import load_run
    from hybridpipe.jsonfile import read_json
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, type=Path, action="append",
                   help="plans.py's --work folder (repeat with --results: the n-th of each go together)")
    p.add_argument("--results", required=True, type=Path, action="append", help="plans.py's results JSON (its groups)")
    p.add_argument("--out", type=Path, help="the results JSON to write (default: the first --results' name + "
                   "_prediction)")
    p.add_argument("--calibration", type=Path, action="append", help="the all-reduce calibration to price with "
                   "instead of the --work folder's allreduceN.json (one per --work, in order; e.g. one with fits per "
                   "group size measured later on the same emulated cluster)")
    p.add_argument("--drop-stalled", type=float, metavar="LIMIT", help="leave out of every run (measurement, noise "
                   "floor and refinement alike) the steady steps in which some rank computed more than LIMIT times its "
                   "own median over the run (a host stalled; observed.stalled_steps), e.g. 1.25")
    p.add_argument("--node-shrink", type=shrink_strength, default=0.0, metavar="STRENGTH|cv",
                   help="pull the per-node compute factors "
                   "toward their common one (refine/shrinkage.py; cv: the strength cross-validated over the training "
                   "runs' stage layouts); default 0, refinement's own")
    p.add_argument("--terms", type=term_list, default=None, metavar="NAME[,NAME]|none",
                   help="stage terms to fit beside the node factors (refinement.TERMS: replicas, accumulation; "
                   "cost/computeterms.py); default refinement's own (both)")
    p.add_argument("--no-step-loss", dest="step_loss", action="store_false",
                   help="refine without the compute lost beside all-reduces fitted from the step times "
                   "(refinement.refine's step_loss; default: fitted, refinement's own)")
    p.add_argument("--step", choices=("simulated", "formula"), default="simulated",
                   help="the step model: the schedule's critical path, one step simulated from a barrier "
                   "(simulator.predicted_step_ms; default, as refine_from_runs) or the partitioner's closed form "
                   "(objective.predict_step_ms)")
    a = p.parse_args(argv)
    a.terms = DEFAULT_TERMS if a.terms is None else a.terms
    shrink = None if a.node_shrink == "cv" else a.node_shrink
    if len(a.work) != len(a.results) or (a.calibration and len(a.calibration) != len(a.work)):
        p.error("give one --work per --results (and one --calibration per --work, if any)")
    groups: dict[str, list[PlanError]] = {}
    out: dict = {"benchmark": "plans_prediction", "machine": machine(), "results": [str(r) for r in a.results],
                 "drop_stalled": a.drop_stalled, "node_shrink": a.node_shrink, "terms": list(a.terms),
                 "step_loss": a.step_loss, "step": a.step, "groups": {}}
    spreads: list[float] = []
    found = [(work, model, hosts, cal) for work, results, cal in zip(a.work, a.results, a.calibration or
                                                                      [None] * len(a.work), strict=True)
             for model, hosts in dict.fromkeys((r["model"], r["hosts"]) for r in read_json(results, "results")["rows"])]
    out["calibrations"] = {}
    for work, model, hosts, cal in found:
        runs = [load_run(d, a.drop_stalled) for d in run_dirs(work, model, hosts)]
        cal_paths = [cal] if cal else sorted(work.glob(f"allreduce{hosts}.json"))
        out["calibrations"][f"{model}, {hosts} hosts"] = [str(c) for c in cal_paths]
        refiner = group_refiner(work / f"{model}.x{hosts}.profile.json",
                                REPO / "examples" / "clusters" / f"{hosts}x1gbit.json", cal_paths, shrink, a.terms,
                                a.step_loss, a.step)
        plans = plan_errors(runs, refiner, refiner([]))
        nodes = read_json(work / f"{model}.x{hosts}.profile.json", "profile")["nodes"]
        fwd, bwd = [n["forward_ms"] for n in nodes], [n["backward_ms"] for n in nodes]
        by_name = {r.name: r for r in runs}
        name = f"{model}, {hosts} hosts"
        groups[name] = plans
        mine = rerun_spreads(group_plans(runs))
        spreads += mine
        out["groups"][name] = {
            "runs": len(runs), "rerun_spreads": mine,
            "plans": [{**p.__dict__, "error_before": p.error(p.before_ms), "error_model": p.error(p.model_ms),
                       "error_in_sample": p.error(p.in_sample_ms),
                       "error_leave_one_out": p.error(p.leave_one_out_ms),
                       "compute_factor_per_stage": [compute_factors(by_name[n], fwd, bwd) for n in p.runs]}
                      for p in plans]}
    out["paired"] = [paired_view(r) for results in a.results for r in read_json(results, "results")["rows"]
                     if r["strategy"] == "autotune" and (r.get("autotune") or {}).get("paired")]
    for g in out["paired"]:
        print(f"{g['group']}: autotune's plan {g['chosen']} paired (ABBA, {g['rounds']} rounds) vs "
              + ", ".join(f"{k} {v:.3f}x the step" for k, v in g["vs"].items())
              + f"; the same plan rerun: {g['rerun_spread']}")
    every = [p for ps in groups.values() for p in ps]
    out["summary"] = {"before": summarize([p.error(p.before_ms) for p in every]),
                      "model": summarize([p.error(p.model_ms) for p in every]),
                      "in_sample": summarize([p.error(p.in_sample_ms) for p in every]),
                      "leave_one_out": summarize([p.error(p.leave_one_out_ms) for p in every]),
                      "noise_floor": {"pairs": len(spreads), "median": statistics.median(spreads) if spreads else None,
                                      "worst": max(spreads) if spreads else None}}
    s = out["summary"]
    for what in ("before", "model", "in_sample", "leave_one_out"):
        e = s[what]
        if e.get("plans"):
            print(f"{what:14s} {e['plans']} plans: median {100 * e['median']:.1f}%, worst {100 * e['worst']:.1f}%, "
                  f"within 3% {e['within_3pct']}, within 10% {e['within_10pct']}")
    nf = s["noise_floor"]
    if nf["pairs"]:
        print(f"noise floor (same plan rerun, {nf['pairs']} pairs): median {100 * nf['median']:.1f}%, "
              f"worst {100 * nf['worst']:.1f}%")
    json_path = a.out or a.results[0].with_name(a.results[0].stem + "_prediction.json")
    title = (f"predicted vs measured step, {len(every)} plans on emulated hosts; leave-one-plan-out median |error| "
             f"{100 * s['leave_one_out'].get('median', float('nan')):.1f}%, same plan rerun "
             f"{100 * (s['noise_floor']['median'] or float('nan')):.0f}%")
    write_results(json_path, out, plot(pyplot(), groups, title), json_path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
