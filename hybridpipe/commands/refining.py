"""Reading runs for ``partition --refine`` / ``autotune`` and showing what refinement learnt.

A run directory is what ``hybridpipe.launch --run-dir R`` wrote: ``R/summary.json`` and the
ranks' timelines (``R/trace/rank-*.json``, or the summary's ``trace_dir``). The numbers go to the
pure ``partitioner/refine/refinement.py``; this module does the files and the words.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridpipe.commands.show import human_bytes, table
from hybridpipe.errors import UserError
from hybridpipe.jsonfile import read_json
from hybridpipe.partitioner.cost.calibration import Calibration, save_calibration
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.refine.observed import RankEvents, RunObservation, observe_run
from hybridpipe.partitioner.refine.refinement import (
    DEFAULT_TERMS,
    TERMS,
    Refinement,
    predict_run,
    refine,
    refined_calibrations,
    refined_profile,
)
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, Options, StageSpec, StepModel
from hybridpipe.profiles.format import Profile, save_profile
from hybridpipe.runtime.timeline import find_rank_traces, load_rank_trace

SHOWN_NODES = 6          # nodes whose residual is furthest from 1, listed


def load_run(run_dir: str | os.PathLike, stall_limit: float | None = None) -> RunObservation:
    """A run directory's observation; a run without a summary or traces is a one-line UserError.
    ``stall_limit``: leave out the steps where a host stalled (``observed.observe_run``)."""
    base = Path(run_dir)
    path = base / "summary.json"
    if not path.is_file():
        raise UserError(f"{base} holds no summary.json: pass the --run-dir of a run that finished")
    summary = read_json(path, "run summary")
    if not isinstance(summary, dict):
        raise UserError(f"{path}: expected a JSON object (a run's summary)")
    traced = summary.get("trace_dir")
    where = base if (base / "trace").is_dir() or not isinstance(traced, str) or not traced else Path(traced)
    traces = [load_rank_trace(p) for p in find_rank_traces(where)]
    ranks = [RankEvents(t.rank, int(t.meta["stage"]), int(t.meta["replica"]),
                        [e for e in t.events if e.get("ph") == "X"]) for t in traces]
    return observe_run(str(base), summary, ranks, stall_limit)


def simulated_step_ms(ev: Evaluation, costs: ModelCosts, stages: Sequence[StageSpec], opts: Options) -> float:
    """The step model runs are predicted with: the schedule's critical path (``simulator.predicted_step_ms``)."""
    from hybridpipe.pipeline.simulator import predicted_step_ms  # here: the pipeline package imports torch

    return predicted_step_ms(ev, costs, stages, opts)


@dataclass(frozen=True)
class Refined:
    """A refinement and the model it makes: the refined profile and calibrations."""

    refinement: Refinement
    profile: Profile
    calibrations: tuple[Calibration, ...]


def refine_from_runs(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration],
                     runs: Sequence[RunObservation], algorithms: Sequence[str] = ALGORITHMS,
                     terms: Sequence[str] = DEFAULT_TERMS, step: StepModel = simulated_step_ms) -> Refined:
    """refine (``terms``: the stage terms to fit, refinement.TERMS) and the refined profile and calibrations;
    the leftover terms fitted under ``step`` (default the schedule's critical path, as runs are predicted)."""
    ref = refine(profile, cluster, calibrations, runs, algorithms, terms=terms, step=step)
    return Refined(ref, refined_profile(profile, ref), refined_calibrations(cluster, calibrations, ref))


def save_refined(refined: Refined, directory: str | os.PathLike) -> list[Path]:
    """Write DIR/profile.json and DIR/calibration.json (one per level: calibration-LEVEL.json)."""
    out = Path(directory)
    paths = [save_profile(refined.profile, out / "profile.json")]
    cals = refined.calibrations
    for cal in cals:
        name = "calibration.json" if len(cals) == 1 else f"calibration-{cal.level}.json"
        paths.append(save_calibration(cal, out / name))
    return paths


def describe(refined: Refined, profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration],
             runs: Sequence[RunObservation]) -> str:
    """What was learnt, for people: compute, nodes, all-reduce classes, p2p, each run re-predicted."""
    ref = refined.refinement
    out = [f"refined from {len(runs)} run(s): compute {ref.compute_slowdown:.2f}x the profile on this cluster"]
    resid = sorted(((ref.forward_factor[i] + ref.backward_factor[i]) / 2 / ref.compute_slowdown, i)
                   for i in range(len(profile.nodes)) if profile.nodes[i].compute_ms > 0)
    odd = sorted(resid, key=lambda x: -abs(x[0] - 1))[:SHOWN_NODES]
    if odd and abs(odd[0][0] - 1) > 0.05:
        out.append("  nodes off their profile (beyond that): " + ", ".join(
            f"{profile.nodes[i].name} {r:.2f}x" for r, i in odd if abs(r - 1) > 0.05))
    for nbytes, factor in ref.allreduce_slowdown:
        out.append(f"  all-reduce of ~{human_bytes(nbytes)}: {factor:.2f}x the model")
    for ranks, points in ref.allreduce_slowdown_groups:
        out.append(f"  over {ranks} ranks: " + ", ".join(f"~{human_bytes(b)} {f:.2f}x" for b, f in points))
    extra = dict(ref.p2p_extra_alpha_s)
    for level, factor in ref.p2p_factor:
        more = f", plus {extra[level] * 1e3:.2f} ms per message handed over" if extra.get(level) else ""
        out.append(f"  p2p at level {cluster.levels[level].name!r}: {factor:.2f}x the model's wire time{more}")
    if ref.interference_s_per_byte is not None:
        out.append(f"  compute lost to the link: {ref.interference_s_per_byte * 1e9:.2f} ms per MB it carries"
                   + (" (could not be told apart from compute: left in the nodes' times)"
                      if not ref.interference_s_per_byte else ""))
    if ref.optimizer_factor != 1.0:
        out.append(f"  optimizer step: {ref.optimizer_factor:.2f}x the profile's (per parameter byte)")
    if ref.tied_factor != 1.0:
        out.append(f"  tied weights' sums across stages: {ref.tied_factor:.2f}x the model")
    if ref.replica_compute:
        out.append("  replicated stages compute " + ", ".join(f"{f:.2f}x with {r} replicas" for r, f in
                                                            ref.replica_compute) + " what their nodes do alone")
    if ref.accumulate_s_per_byte:
        out.append(f"  gradient accumulation: {ref.accumulate_s_per_byte * 1e9:.2f} ms per MB per later backward")
    if ref.step_overhead_ms:
        out.append(f"  per step beyond what the model prices: {ref.step_overhead_ms:.1f} ms")
    rows: list[list[object]] = []
    for run in runs:
        before = predict_run(profile, cluster, calibrations, run, step=simulated_step_ms)
        after = predict_run(refined.profile, cluster, refined.calibrations, run, step=simulated_step_ms)
        measured = run.measured_step_ms
        rows.append([run.name, "|".join(f"{s.first}-{s.last}x{len(s.ranks)}" for s in run.stages),
                     f"{before:.1f}", f"{after:.1f}", f"{measured:.1f}" if measured else "-",
                     f"{100 * (after - measured) / measured:+.1f}%" if measured else "-"])
    out.append(table(["run", "stages", "predicted before ms", "after ms", "measured ms", "error after"], rows))
    return "\n".join(out)


def refine_terms(text: str) -> tuple[str, ...]:
    """``--refine-terms A,B`` (or ``none``): the stage terms refinement fits beside the node factors
    (refinement.TERMS)."""
    if text.strip() == "none":
        return ()
    terms = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in terms if t not in TERMS]
    if unknown or not terms:
        raise argparse.ArgumentTypeError(f"unknown term(s) {', '.join(unknown) or repr(text)}; choose from "
                                         f"{', '.join(TERMS)} (comma-separated), or none")
    return terms

