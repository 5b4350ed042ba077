"""``hybridpipe autotune PROFILE --cluster C --steps N -- COMMAND ...``: plan, run, refine, re-plan.

Each round makes every strategy's plan with the model refined by all runs so far
(``partitioner/refine/refinement.py``), picks the next plan to run (``partitioner/refine/tuning.py``: the best
predicted, or a runner-up when the ranking is close), writes it to ``OUT/plans/plan-K.json``
and runs the user's own command line for N steps: ``{plan}``, ``{run_dir}`` and ``{steps}`` in
its arguments are replaced by the plan's path, ``OUT/runs/run-K`` and N. The command is run as
an argument list (no shell), in its own process group, killed when it outlasts
``--run-timeout``; its output goes to ``OUT/runs/run-K.log``. For example::

    hybridpipe autotune profile.json --cluster examples/clusters/local4.json --steps 20 -- \\
        torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan {plan} \\
        --steps {steps} --run-dir {run_dir} --timeout 120

It stops when the best predicted plan is the fastest measured and was predicted within
``--tolerance`` before it ran, when no untried plan is predicted within ``--close`` of the best,
or after ``--budget`` runs. It writes the fastest measured plan to ``OUT/plan.json``, the report
``OUT/autotune.json`` (every plan tried: why, predicted before it ran, predicted by the final
model, measured) and the refined model (``OUT/refined/profile.json``, ``calibration.json``: give
the calibration to later ``partition`` runs of any model on this cluster). ``--runs RUN_DIR ...``:
earlier runs of the model on the cluster (other plans', e.g. the strategies'), refined from before
the first round, so its first choice and its trust in a prediction rest on every run, not its own
first one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridpipe.argtypes import output_dir, positive_float, positive_int
from hybridpipe.commands.refining import Refined, describe, load_run, refine_from_runs, save_refined, simulated_step_ms
from hybridpipe.commands.runnable import runnable
from hybridpipe.commands.show import table
from hybridpipe.errors import UserError, one_line
from hybridpipe.jsonfile import write_json
from hybridpipe.partitioner.cost.calibration import Calibration, load_calibration
from hybridpipe.partitioner.cost.cluster import Cluster, load_cluster
from hybridpipe.partitioner.plan import ALGORITHMS, OPTIMIZER_HELP, OPTIMIZERS, STRATEGIES, load_plan, save_plan
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.refine.observed import RunObservation
from hybridpipe.partitioner.refine.refinement import predict_run
from hybridpipe.partitioner.refine.tuning import (
    Candidate,
    Trial,
    decide,
    distinct,
    fastest_measured,
    plan_key,
    pooled,
    relative_error,
)
from hybridpipe.partitioner.schedule_registry import DEFAULT_SCHEDULE
from hybridpipe.profiles.format import Profile, load_profile

REPORT_KIND = "autotune-report"
REPORT_FORMAT = 1
PLACEHOLDERS = ("{plan}", "{run_dir}", "{steps}")
TAKES_COMMAND = True          # cli.py hands everything after "--" over as args.command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile JSON written by `hybridpipe profile`")
    parser.add_argument("--cluster", required=True, metavar="C.json", help="cluster description")
    parser.add_argument("--calibration", action="append", default=[], metavar="CAL.json",
                        help="measured costs (bench-allreduce, or a refined calibration); repeatable")
    parser.add_argument("--steps", type=positive_int, required=True, metavar="N",
                        help="steps of each short run ({steps} in the command; the first fifth are warm-up)")
    parser.add_argument("--budget", type=positive_int, default=4, metavar="R", help="at most R runs (default 4)")
    parser.add_argument("--runs", nargs="+", default=[], metavar="RUN_DIR",
                        help="earlier runs of this model on this cluster (launch --run-dir with the timeline on): the "
                        "model is refined from them before the first plan is chosen, and from them with its own later")
    parser.add_argument("--out", type=output_dir, metavar="DIR", help="where plans, runs and the report go "
                        "(default autotune/<time>)")
    parser.add_argument("--run-timeout", type=positive_float, default=600.0, metavar="S",
                        help="kill a run after S seconds (default 600)")
    parser.add_argument("--tolerance", type=positive_float, default=0.05, metavar="X",
                        help="converged when the best plan was predicted within X before it ran (default 0.05)")
    parser.add_argument("--close", type=positive_float, default=0.5, metavar="X",
                        help="until converged, run untried plans predicted within X of the best (default 0.5)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), metavar="A,B",
                        help=f"strategies whose plans compete (default {','.join(STRATEGIES)})")
    parser.add_argument("--workers", type=positive_int, metavar="N", help="use N workers (default: the cluster)")
    add_schedule_option(parser, default=DEFAULT_SCHEDULE)
    add_micro_batches_option(parser, default="2 per worker")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help=f"optimizer (default sgd; {OPTIMIZER_HELP})")
    parser.add_argument("--memory-gb", type=positive_float, metavar="X", help="memory per worker")
    parser.usage = "hybridpipe autotune PROFILE --cluster C --steps N [options] -- COMMAND ..."
    parser.epilog = ("COMMAND (after --): how to start a job, as an argument list with {plan}, {run_dir} and "
                     "optionally {steps}; e.g. -- torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch "
                     "--plan {plan} --steps {steps} --run-dir {run_dir}")


def job_argv(command: Sequence[str], plan: Path, run_dir: Path, steps: int) -> list[str]:
    """The user's command with the placeholders replaced (each argument on its own; no shell)."""
    out = []
    for arg in command:
        for key, value in zip(PLACEHOLDERS, (str(plan), str(run_dir), str(steps)), strict=True):
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def check_command(command: Sequence[str]) -> list[str]:
    cmd = list(command)
    if not cmd:
        raise UserError("no job command: end the options with -- and the command that starts a run, e.g. "
                        "-- torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan {plan} "
                        "--steps {steps} --run-dir {run_dir}")
    for key in PLACEHOLDERS[:2]:
        if not any(key in a for a in cmd):
            raise UserError(f"the job command has no {key}: autotune puts each plan's path in {{plan}} and its run "
                            "directory in {run_dir} (e.g. --plan {plan} --run-dir {run_dir})")
    return cmd


def run_job(argv: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """Run one job (own process group, output to ``log``); (exit code, seconds); 124 when it timed out."""
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise UserError(f"cannot start the job command {argv[0]!r}: {e.strerror or e}") from None
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = 124
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
    return code, time.monotonic() - start


@dataclass
class Tried:
    """One run of autotune (for the report)."""

    index: int
    candidate: Candidate
    reason: str
    plan_path: Path
    run_dir: Path
    exit_code: int
    seconds: float
    measured_ms: float | None
    error: str = ""
    steps_ms: tuple[float, ...] = ()


def candidates(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration], req: Request,
               strategies: Sequence[str]) -> list[Candidate]:
    """Every strategy's plan with this model, merged where equal; fastest predicted first."""
    plans = []
    for name in strategies:
        try:
            plans.append((name, runnable(lambda r: partition(profile, cluster, r, calibrations),
                                         Request(**{**req.__dict__, "strategy": name})).plan))
        except UserError:
            continue                              # a strategy with no feasible plan competes with none
    return distinct(plans)


def run(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    cluster = load_cluster(args.cluster)
    calibrations = [load_calibration(p) for p in args.calibration]
    command = check_command(args.command)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise UserError(f"--strategies must name some of {', '.join(STRATEGIES)}; got {args.strategies!r}")
    req = Request(workers=args.workers, schedule=args.schedule, micro_batches=args.micro_batches,
                  optimizer=args.optimizer, memory_gb=args.memory_gb, algorithms=ALGORITHMS)
    out = Path(args.out or Path("autotune") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    tried: list[Tried] = []
    runs: list[RunObservation] = []
    earlier = [load_run(d) for d in args.runs]
    refined: Refined | None = refine_from_runs(profile, cluster, calibrations, earlier) if earlier else None
    tried.extend(earlier_trials(args.runs, earlier))       # measured plans: ranked with autotune's own runs
    reason = f"budget of {args.budget} runs spent"
    for k in range(args.budget):
        prof, cals = (refined.profile, list(refined.calibrations)) if refined else (profile, calibrations)
        found = candidates(prof, cluster, cals, req, strategies)
        for t in tried:                            # a plan tried before stays runnable again (re-measuring)
            if all(c.key != t.candidate.key for c in found):
                found.append(t.candidate)
        decision = decide(found, trials_of(tried), tolerance=args.tolerance, close=args.close)
        if decision.candidate is None:
            reason = decision.reason
            break
        c = decision.candidate
        plan_path = save_plan(c.plan, out / "plans" / f"plan-{k}.json")
        run_dir = out / "runs" / f"run-{k}"
        print(f"autotune run {k}: {'/'.join(c.strategies)} plan {layout(c)}, predicted {c.predicted_ms:.1f} ms "
              f"({decision.reason})", flush=True)
        code, seconds = run_job(job_argv(command, plan_path, run_dir, args.steps), out / "runs" / f"run-{k}.log",
                                args.run_timeout)
        t = Tried(k, c, decision.reason, plan_path, run_dir, code, seconds, None)
        tried.append(t)
        try:
            obs = load_run(run_dir)
            t.measured_ms = obs.measured_step_ms
            t.steps_ms = obs.step_times_ms
        except UserError as e:
            t.error = one_line(e)
            print(f"  run {k} gave nothing to learn from (exit {code}; log {out / 'runs' / f'run-{k}.log'}): "
                  f"{t.error}", flush=True)
            continue
        print(f"  measured {t.measured_ms:.1f} ms/step (exit {code}, {seconds:.0f} s)" if t.measured_ms
              else f"  no measured step (exit {code})", flush=True)
        if code != 0 or t.measured_ms is None:
            continue
        runs.append(obs)
        refined = refine_from_runs(profile, cluster, calibrations, [*earlier, *runs])
    return finish(out, args, profile, cluster, calibrations, tried, runs, refined, reason, earlier)


def earlier_trials(dirs: Sequence[str], earlier: Sequence[RunObservation]) -> list[Tried]:
    """The ``--runs`` whose directory holds the plan they ran (launch writes ``plan.json`` there), as trials
    numbered -1, -2, ...: their measurements compete with autotune's own runs for "the fastest measured"
    and the chosen plan. A run without its plan only refines the model."""
    out = []
    for i, (d, obs) in enumerate(zip(dirs, earlier, strict=True)):
        path = Path(d) / "plan.json"
        if not path.is_file() or obs.measured_step_ms is None:
            continue
        plan = load_plan(path)
        out.append(Tried(-1 - i, Candidate(plan_key(plan), plan, ("--runs",)), "an earlier run (--runs)", path,
                         Path(d), 0, 0.0, obs.measured_step_ms, steps_ms=tuple(obs.step_times_ms)))
    return out


def trials_of(tried: Sequence[Tried]) -> list[Trial]:
    """What tuning.py reads of the runs so far (a run that exited non-zero counts as failed)."""
    return [Trial(t.candidate.key, t.candidate.predicted_ms, t.measured_ms if t.exit_code == 0 else None, t.steps_ms)
            for t in tried]


def layout(c: Candidate) -> str:
    return " | ".join(f"{s.first_node}-{s.last_node}x{s.replicas}" for s in c.plan.stages)


def finish(out: Path, args, profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration],
           tried: list[Tried], runs: list[RunObservation], refined: Refined | None, reason: str,
           earlier: Sequence[RunObservation] = ()) -> int:
    """Write the chosen plan, the refined model and the report; print the table. Exit 1 if no run measured.
    ``earlier``: the runs of ``--runs`` (refined from; those with their plan are in ``tried``, numbered < 0)."""
    ranked = pooled(trials_of(tried))
    best = fastest_measured(trials_of(tried))
    chosen = next((t for t in tried if best is not None and t.candidate.key == best.key), None)
    chosen_pooled = ranked[0] if ranked else None
    final: dict[int, float] = {}
    if refined is not None:
        for t, obs in zip([t for t in tried if t.index >= 0 and t.exit_code == 0 and t.measured_ms is not None], runs,
                          strict=True):
            final[t.index] = predict_run(refined.profile, cluster, refined.calibrations, obs, step=simulated_step_ms)
        save_refined(refined, out / "refined")
        print(describe(refined, profile, cluster, calibrations, [*earlier, *runs]))
    rows: list[list[object]] = []
    entries = []
    for t in tried:
        err = relative_error(t.candidate.predicted_ms, t.measured_ms) if t.measured_ms else None
        after = final.get(t.index)
        entries.append({"run": t.index, "strategies": list(t.candidate.strategies), "stages": layout(t.candidate),
                        "why": t.reason, "plan": str(t.plan_path), "run_dir": str(t.run_dir),
                        "exit_code": t.exit_code, "seconds": round(t.seconds, 1),
                        "predicted_ms": t.candidate.predicted_ms, "measured_ms": t.measured_ms,
                        "steps_ms": list(t.steps_ms),
                        "error_before_run": err, "predicted_final_ms": after,
                        "error_final": relative_error(after, t.measured_ms) if after and t.measured_ms else None,
                        "note": t.error})
        rows.append([t.index, "/".join(t.candidate.strategies), layout(t.candidate), t.reason,
                     f"{t.candidate.predicted_ms:.1f}", f"{after:.1f}" if after else "-",
                     f"{t.measured_ms:.1f}" if t.measured_ms else f"failed ({t.exit_code})",
                     "*" if chosen is t else ""])
    print(table(["run", "strategies", "stages", "why", "predicted ms", "final model ms", "measured ms", "chosen"],
                rows) if rows else "no run")
    print(f"stopped: {reason}")
    report = {"kind": REPORT_KIND, "format": REPORT_FORMAT, "profile": str(args.profile), "cluster": str(args.cluster),
              "calibrations": list(args.calibration), "earlier_runs": [r.name for r in earlier],
              "steps": args.steps, "budget": args.budget,
              "tolerance": args.tolerance, "close": args.close, "stop_reason": reason,
              "runs": sum(t.index >= 0 for t in tried),
              "chosen": chosen.index if chosen else None, "trials": entries,
              "chosen_measured_ms": chosen_pooled.median_ms if chosen_pooled else None,
              "chosen_runs": chosen_pooled.runs if chosen_pooled else 0,
              "chosen_noise": chosen_pooled.noise if chosen_pooled else None,
              "refined": {"profile": str(out / "refined" / "profile.json"),
                          "calibration_dir": str(out / "refined")} if refined else None}
    write_json(out / "autotune.json", report)
    if chosen is None:
        print(f"no run measured a step: see the logs under {out / 'runs'}; report {out / 'autotune.json'}")
        return 1
    save_plan(chosen.candidate.plan, out / "plan.json")
    assert chosen_pooled is not None
    which = f"run {chosen.index}" if chosen.index >= 0 else f"the earlier run {chosen.run_dir}"
    print(f"wrote {out / 'plan.json'} ({which}, measured {chosen_pooled.median_ms:.1f} ms/step over "
          f"{chosen_pooled.runs} run(s)), "
          f"report {out / 'autotune.json'}")
    return 0
