"""What a plan's prediction error is made of: its step split into terms, read from each rank's timeline and
from the cost model's prediction for the same stages (issue 30 item 4).

    python benchmarks/plans_terms.py --work /tmp/quiet-bench \
        --results benchmarks/results/plans_quiet_alexnet_quick.json --work /tmp/quiet-bench-llama \
        --results benchmarks/results/plans_quiet_llama_quick.json --out terms.json

A flushed schedule (gpipe, 1f1b) ends every step on every rank at once, so on every stage

    step = compute + sync + optimizer + wait

* **compute**: the stage's forwards and backwards of one step (``k`` micro-batches per replica; the first
  stage's loading of the batch counts as compute, as ``observed.py`` counts it). Measured: the ``run_for``
  (+ ``receive_for`` on stage 0) and ``run_back`` phases; predicted: ``k (F + B)`` plus the compute the model
  says the stage loses to its own communication (``interference``).
  ``overlap_stretch`` (measured, replicated stages): how much longer the step's last backward took than
  the median of its others: the compute the per-layer all-reduces running beside it took from it.
* **sync**: the wait for the gradient all-reduces after the last backward (what they did not hide).
  Measured: the ``sync`` phase; predicted: the exposed time of the per-layer lane (``layersync.py``)
  beyond the gap the transfers before the stage add, less what the backward's stretch beside the
  all-reduces (``interference`` on the overlapped part) hid of it. ``allreduce_busy`` (predicted): the all-reduces'
  whole time, hidden or not.
* **optimizer**: the ``step`` phase's own work (tied sums and the optimizer step); predicted: the optimizer's
  price and the tied sums'. Measured: the phase after the latest rank to enter it before it ended. Before its
  optimizer step every rank joins the loss check (``runtime/nonfinite.py``: a scalar collective over the
  world), so a rank that ends its backward early waits in the phase for the latest rank (on 8 emulated hosts,
  step phases of 355-940 ms held 20-50 ms of own work): that wait is the pipeline's drain and counts as wait.
* **wait**: the rest: the fill and drain bubbles, waiting for messages (p2p transfer times) and for
  slower stages. Measured: the step time less the three above; predicted: the same on the model's step.

Per plan the error ``predicted - measured`` of its step is then the sum of the four terms' differences on
any stage; the tables show them on the stage the model's step comes from (its binding stage) and the
``p2p`` ratio (measured wire seconds over the model's, receivers' records). Measured terms are medians
over the steady steps (per rank) and over replicas, pooled over every run of the plan (each run's median,
then the median over runs). Predictions: before refinement and leave-one-plan-out (refined from the
group's other plans' runs), as ``plans_prediction.py`` makes them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridpipe.partitioner.refine.observed import (
    RankEvents,
    RunObservation,
    job_step_map,
    steady_steps,
    without_settling,
)
from hybridpipe.partitioner.refine.refinement import DEFAULT_TERMS

TERMS = ("compute", "sync", "optimizer", "wait")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def step_entries(ranks: Sequence[RankEvents], steps: set[int]) -> dict[int, list[float]]:
    """Per step, when each rank entered its ``step`` phase (trace us; the traces share a time origin)."""
    out: dict[int, list[float]] = {s: [] for s in steps}
    for r in ranks:
        for e in r.events:
            step = e.get("args", {}).get("step")
            if e.get("cat") == "phase" and e.get("name") == "step" and step in out:
                out[step].append(float(e["ts"]))
    return out


def rank_terms(events: Sequence[dict], steps: set[int], *, loads_input: bool,
               entered: dict[int, list[float]] | None = None) -> dict[str, float]:
    """One rank's terms (ms, median over ``steps``) from its trace events (module docstring). ``entered``
    (:func:`step_entries` of every rank): the step phase's wait for the latest rank counts as wait."""
    per: dict[int, dict[str, float]] = {s: dict.fromkeys(("compute", "sync", "optimizer", "step"), 0.0)
                                        for s in steps}
    backs: dict[int, list[float]] = {s: [] for s in steps}
    compute = ("run_for", "run_back", "receive_for") if loads_input else ("run_for", "run_back")
    for e in events:
        step = e.get("args", {}).get("step")
        if step not in steps:
            continue
        ms = float(e["dur"]) / 1e3
        if e.get("cat") == "step":
            per[step]["step"] = ms
        elif e.get("cat") == "phase":
            name = e.get("name")
            if name in compute:
                per[step]["compute"] += ms
            if name == "run_back":
                backs[step].append(ms)
            elif name == "sync":
                per[step]["sync"] += ms
            elif name == "step":
                t0, t1 = float(e["ts"]), float(e["ts"]) + float(e["dur"])
                latest = max([t0, *(t for t in (entered or {}).get(step, ()) if t <= t1)])
                per[step]["optimizer"] += (t1 - latest) / 1e3
    out = {t: _median([p[t] for p in per.values()]) for t in ("compute", "sync", "optimizer", "step")}
    out["wait"] = out["step"] - out["compute"] - out["sync"] - out["optimizer"]
    out["overlap_stretch"] = _median([b[-1] - _median(b[:-1]) for b in backs.values() if len(b) > 1])
    return out


def measured_terms(ranks: Sequence[RankEvents], warmup: int, stages: int,
                   jobs: dict[int, float] | None = None) -> list[dict[str, float]]:
    """Per stage: the median over its replicas of :func:`rank_terms` over the run's steady steps (less the
    leading ones still warming up by the job's step times ``jobs``, as ``observed.observe_run`` leaves them)."""
    steps = without_settling(steady_steps(ranks, warmup), jobs or {})
    entered = step_entries(ranks, steps)
    out = []
    for k in range(stages):
        mine = [rank_terms(r.events, steps, loads_input=k == 0, entered=entered) for r in ranks if r.stage == k]
        out.append({t: _median([m[t] for m in mine]) for t in (*TERMS, "step", "overlap_stretch")})
    return out


def predicted_terms(profile, cluster, calibrations, run: RunObservation, optimizer: str = "sgd") -> dict:
    """The model's terms per stage for the stages ``run`` ran, and which stage its step comes from."""
    from hybridpipe.partitioner.cost.costmodel import CostModel
    from hybridpipe.partitioner.planner import priced_tied
    from hybridpipe.partitioner.refine.refinement import base_costs
    from hybridpipe.partitioner.schedule_registry import get_schedule
    from hybridpipe.partitioner.search.objective import StageSpec, evaluate, predict_step_ms
    from hybridpipe.partitioner.search.options import Options
    model = CostModel(cluster, list(calibrations))
    specs = [StageSpec(s.first, s.last, s.ranks) for s in run.stages]
    opts = Options(get_schedule(run.schedule), run.micro_batches, optimizer, math.inf)
    costs = base_costs(profile, model)
    ev = evaluate(costs, model, specs, opts)
    tied, tied_total = [0.0] * len(specs), 0.0
    for g in priced_tied(profile, specs, model):
        tied_total += g.predicted_ms
        for k in g.stages:
            tied[k] += g.predicted_ms
    total = predict_step_ms(ev, opts) + tied_total + model.step_overhead_ms      # as predict_run
    share = opts.schedule.drain_backward_share
    before, lines, stages = 0.0, [], []
    trip = sum(s.forward_ms + share * s.backward_ms + s.send_ms + s.send_grad_ms for s in ev.stages)
    for k, s in enumerate(ev.stages):
        st = run.stages[k]
        opt = s.syncs_per_step * float(costs.optimizer_ms(optimizer)[st.first:st.last + 1].sum())
        late = max(0.0, s.sync.exposed_ms - before)          # as predict_step_ms
        beside = s.overlapped_ring_ms                           # stretches the backward, hides as much sync
        before += s.send_ms + s.send_grad_ms
        lines.append(trip + (1 - share) * s.backward_ms + (s.micro_batches - 1) * (s.forward_ms + s.backward_ms)
                     + max(late, beside) + s.overhead_ms - s.ring_ms + s.midstep_ms)
        lost = s.overhead_ms - s.ring_ms - opt + beside
        compute = s.micro_batches * (s.forward_ms + s.backward_ms) + lost + s.midstep_ms
        stages.append({"compute": compute, "sync": max(0.0, late - beside), "optimizer": opt + tied[k],
                       "interference": lost,
                       "allreduce_busy": s.sync.busy_ms, "k": s.micro_batches})
    for term in stages:
        term["wait"] = total - term["compute"] - term["sync"] - term["optimizer"]
    return {"step": total, "stages": stages, "binding": max(range(len(lines)), key=lines.__getitem__)}


def run_ranks(run_dir: Path) -> tuple[list[RankEvents], int, dict[int, float]]:
    """A run directory's rank traces (as ``commands/refining.load_run`` reads them), its warm-up steps and
    the job's step times."""
    from hybridpipe.jsonfile import read_json
    from hybridpipe.runtime.timeline import find_rank_traces, load_rank_trace
    summary = read_json(run_dir / "summary.json", "run summary")
    traces = [load_rank_trace(p) for p in find_rank_traces(run_dir)]
    return ([RankEvents(t.rank, int(t.meta["stage"]), int(t.meta["replica"]),
                        [e for e in t.events if e.get("ph") == "X"]) for t in traces],
            int(summary.get("warmup_steps", 0)), job_step_map(summary))


def pooled_terms(per_run: Sequence[Sequence[dict[str, float]]]) -> list[dict[str, float]]:
    """Per stage and term, the median over runs."""
    return [{t: _median([run[k][t] for run in per_run]) for t in per_run[0][k]} for k in range(len(per_run[0]))]


def p2p_ratio(runs: Sequence[RunObservation], model) -> float | None:
    """Median over the receivers' transfers of measured wire seconds over the model's."""
    ratios = [t.seconds / p for r in runs for t in r.transfers if t.sent is False
              and (p := model.p2p_seconds(t.nbytes, model.level_between(t.rank, t.peer))) > 0]
    return _median(ratios) if ratios else None


def differences(measured: Sequence[dict], predicted: dict) -> dict[str, float]:
    """predicted - measured per term on the model's binding stage (they sum to the step's error)."""
    k = predicted["binding"]
    return {t: round(predicted["stages"][k][t] - measured[k][t], 1) for t in TERMS}


def group_terms(work: Path, model: str, hosts: int, cluster_path: Path, calibration: Path | None = None,
                terms: Sequence[str] = DEFAULT_TERMS) -> list[dict]:
    """Every plan of a group with its measured and predicted terms (module docstring)."""
    from benchmarks.plans_prediction import group_plans, layout, pooled_ms, run_dirs
    from hybridpipe.commands.refining import load_run, refine_from_runs
    from hybridpipe.partitioner.cost.calibration import load_calibration
    from hybridpipe.partitioner.cost.cluster import load_cluster
    from hybridpipe.partitioner.cost.costmodel import CostModel
    from hybridpipe.profiles.format import load_profile
    profile, cluster = load_profile(work / f"{model}.x{hosts}.profile.json"), load_cluster(cluster_path)
    paths = [calibration] if calibration else sorted(work.glob(f"allreduce{hosts}.json"))
    cals = [load_calibration(c) for c in paths]
    dirs = run_dirs(work, model, hosts)
    runs = [load_run(d) for d in dirs]
    traces = {r.name: run_ranks(d) for r, d in zip(runs, dirs, strict=True)}
    plans = group_plans(runs)
    out = []
    for key, mine in plans.items():
        if get_async(mine[0].schedule):
            continue
        others = [r for k, rs in plans.items() if k != key for r in rs]
        measured = pooled_terms([measured_terms(*traces[r.name][:2], len(r.stages),
                                                    traces[r.name][2]) for r in mine])
        before = predicted_terms(profile, cluster, cals, mine[0])
        row = {"layout": layout(mine[0]), "runs": len(mine), "measured_ms": pooled_ms(mine), "measured": measured,
               "p2p_measured_over_model": p2p_ratio(mine, CostModel(cluster, cals)),
               "before": before, "before_minus_measured": differences(measured, before)}
        if others:
            refined = refine_from_runs(profile, cluster, cals, others, terms=terms)
            loo = predicted_terms(refined.profile, cluster, refined.calibrations, mine[0])
            row |= {"leave_one_out": loo, "leave_one_out_minus_measured": differences(measured, loo),
                    "p2p_measured_over_leave_one_out": p2p_ratio(mine, CostModel(cluster, list(refined.calibrations)))}
        out.append(row)
    return out


def get_async(schedule: str) -> bool:
    from hybridpipe.partitioner.schedule_registry import get_schedule
    return get_schedule(schedule).asynchronous


def show(name: str, rows: Sequence[dict]) -> None:
    print(f"== {name}: predicted - measured per term on the binding stage (ms), "
          "then measured / predicted (before, leave-one-out) per stage")
    for r in rows:
        for what in ("before", "leave_one_out"):
            if what not in r:
                continue
            p, d = r[what], r[f"{what}_minus_measured"]
            err = 100 * (p["step"] - r["measured_ms"]) / r["measured_ms"]
            print(f"{r['layout']:38s} {what:13s} step {p['step']:7.0f} vs {r['measured_ms']:7.0f} ({err:+5.1f}%) "
                  f"binding stage {p['binding']}: " + ", ".join(f"{t} {v:+.0f}" for t, v in d.items()))
        for k, m in enumerate(r["measured"]):
            b = r["before"]["stages"][k]
            lo = r.get("leave_one_out", r["before"])["stages"][k]
            print(f"    stage {k}: " + "  ".join(f"{t} {m[t]:.0f}/{b[t]:.0f}/{lo[t]:.0f}" for t in TERMS)
                  + f"  stretch {m['overlap_stretch']:.0f}, all-reduce busy {b['allreduce_busy']:.0f}/"
                  f"{lo['allreduce_busy']:.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    import json

    from benchmarks.common import REPO
    from benchmarks.plans_prediction import term_list
    from hybridpipe.jsonfile import read_json, write_text
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, type=Path, action="append", help="plans.py's --work folder")
    p.add_argument("--results", required=True, type=Path, action="append", help="plans.py's results JSON")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p.add_argument("--calibration", type=Path, action="append",
                   help="price with this calibration instead of the --work folder's (one per --work, in order)")
    p.add_argument("--terms", type=term_list, default=DEFAULT_TERMS, metavar="NAME[,NAME]|none",
                   help="stage terms to fit beside the node factors (as plans_prediction.py's --terms; default both)")
    a = p.parse_args(argv)
    if len(a.work) != len(a.results) or (a.calibration and len(a.calibration) != len(a.work)):
        p.error("give one --work per --results (and one --calibration per --work, if any)")
    out: dict = {"benchmark": "plans_terms", "terms": list(a.terms), "groups": {}}
    for work, results, cal in zip(a.work, a.results, a.calibration or [None] * len(a.work), strict=True):
        for model, hosts in dict.fromkeys((r["model"], r["hosts"]) for r in read_json(results, "results")["rows"]):
            name = f"{model}, {hosts} hosts"
            out["groups"][name] = rows = group_terms(work, model, hosts,
                                                     REPO / "examples" / "clusters" / f"{hosts}x1gbit.json", cal,
                                                     a.terms)
            show(name, rows)
    write_text(a.out, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
