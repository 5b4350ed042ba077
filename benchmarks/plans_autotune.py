"""plans.py's autotune rows: autotune on the emulated cluster, the paired comparison with the
fastest strategy, and the summary.

Autotune's plan and the strategies' plans are measured minutes apart, and on this shared
machine the same plan's step time moved 2x between two such runs (RESULTS.md 4b). So after
autotune, when the plan it chose is not the fastest strategy's, the two run alternately
(A B B A ...: a load that rises or falls through the rounds weighs on both alike), and the
ratio of the medians of their pooled steady steps is the comparison the aim is judged on.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from benchmarks.plans_analysis import plan_key, refusal_lines, row_from
from hybridpipe.jsonfile import read_json
from hybridpipe.partitioner.refine.observed import settling_steps

# train(plan file, run dir) -> the run's summary.json ({"failed": ...} when it failed)
Train = Callable[[Path, Path], dict]


def autotune_row(cli: Callable, cluster, name: str, hosts: int, args, work: Path, scaled: Path, cluster_file: Path,
                 calibrations: Sequence[Path], port: int, launch_timeout: float,
                 capture_cache: Path | None = None, earlier: Sequence[Path] = ()) -> dict:
    """``hybridpipe autotune`` on the emulated cluster; the row of the plan it chose (see the docstring).

    ``capture_cache``: the model's capture from an earlier run (plans_steps.train_plan), copied into each
    run directory before the job starts (a shell in front of the job: autotune runs the command as given).
    ``earlier``: the strategies' traced run directories, refined from before autotune's first choice (--runs)."""
    out = work / f"autotune-{name}-{hosts}"
    job = [sys.executable, "-m", "tools.emucluster", "torchrun", "--name", cluster.tag, "--timeout",
           str(args.timeout), "--port", str(port), "--", "launch.py", "--plan", "{plan}", "--steps", "{steps}",
           "--run-dir", "{run_dir}", "--no-progress", "--timeout", str(launch_timeout)]
    if capture_cache is not None:
        job = ["sh", "-c", 'mkdir -p "$1" && { cp -r "$2" "$1/capture" 2>/dev/null || true; } && shift 2 && exec "$@"',
               "seed-capture", "{run_dir}", str(capture_cache), *job]
    cmd = ["autotune", str(scaled), "--cluster", str(cluster_file), "--steps", str(args.autotune_steps), "--budget",
           str(args.autotune_budget), "--out", str(out), "--run-timeout", str(args.timeout)]
    for c in calibrations:
        cmd += ["--calibration", str(c)]
    if earlier:
        cmd += ["--runs", *map(str, earlier)]
    t = time.monotonic()
    r = cli([*cmd, "--", *job], timeout_s=args.timeout * (args.autotune_budget + 1), threads=1)
    wall = time.monotonic() - t
    report_path = out / "autotune.json"
    if r.returncode or not report_path.exists():
        return {"model": name, "hosts": hosts, "strategy": "autotune", "status": "failed",
                "reason": refusal_lines((r.stderr or r.stdout)[-2000:]), "autotune": {"wall_s": round(wall, 1)}}
    report = read_json(report_path, "autotune report")
    chosen = next(t for t in report["trials"] if t["run"] == report["chosen"])
    summary = read_json(Path(chosen["run_dir"]) / "summary.json", "summary")
    summary["wall_s"] = chosen["seconds"]
    row = row_from(name, hosts, "autotune", read_json(out / "plan.json", "plan"), summary)
    if report.get("chosen_measured_ms"):         # every steady step of the chosen plan's runs, pooled
        row["measured_step_ms"] = report["chosen_measured_ms"]
    row["autotune"] = {"runs": report["runs"], "stop_reason": report["stop_reason"], "wall_s": round(wall, 1),
                       "chosen_run": report["chosen"], "error_final": chosen["error_final"],
                       "chosen_runs": report.get("chosen_runs"), "chosen_noise": report.get("chosen_noise"),
                       "steps_per_run": args.autotune_steps,
                       "trials": [{k: t[k] for k in ("run", "strategies", "stages", "why", "predicted_ms",
                                                     "predicted_final_ms", "measured_ms", "error_final")}
                                  for t in report["trials"]]}
    return row


def steady_steps(summary: dict) -> list[float]:
    """The job's step times after the summary's warm-up (the first fifth, at least 1) and the leading steps
    still warming up after it (``observed.settling_steps``, as refinement and plans_prediction.py read them)."""
    steps = sorted((int(k), float(v)) for k, v in (summary.get("job_step_ms") or {}).items())
    times = [v for _, v in steps[int(summary.get("warmup_steps") or 0):]]
    return times[settling_steps(times):]


def fastest_strategy(rows: Sequence[dict]) -> dict | None:
    """The strategy row (not autotune, not a duplicate) that measured the fastest step."""
    ok = [r for r in rows if r["strategy"] != "autotune" and r.get("measured_step_ms") and not r.get("same_plan_as")]
    return min(ok, key=lambda r: r["measured_step_ms"]) if ok else None


def paired_comparison(train: Train, tuned_plan: Path, fastest_plan: Path, work: Path, rounds: int,
                      others: Mapping[str, Path] | None = None) -> dict:
    """Run autotune's plan, the fastest strategy's and ``others`` (name -> plan file, e.g. ``uniform``)
    alternately ``rounds`` times each, the order reversed every other round (A B C, C B A, ...); a plan
    identical to one before it runs once. Their pooled medians, autotune's ratio to each, and each plan's
    round-to-round spread (the same plan rerun: the noise the ratios are judged against)."""
    named: dict[str, Path] = {"autotune": tuned_plan, "fastest": fastest_plan, **(others or {})}
    keys = {who: plan_key(read_json(plan, "plan")) for who, plan in named.items()}
    runs: dict[str, Path] = {}
    alias: dict[str, str] = {}
    for who, plan in named.items():
        first = next((w for w in runs if keys[w] == keys[who]), None)
        if first is None:
            runs[who] = plan
        else:
            alias[who] = first
    if len(runs) == 1:
        return {"same_plan": True, "ratio": 1.0, "rounds": 0, "same_as": alias}
    steps: dict[str, list[float]] = {who: [] for who in runs}
    per_round: dict[str, list[float]] = {who: [] for who in runs}
    failed = []
    for k in range(rounds):
        order = list(runs.items())
        for who, plan in (order if k % 2 == 0 else order[::-1]):
            summary = train(plan, work / f"pair-{k}-{who}")
            if "failed" in summary:
                failed.append(f"round {k} {who}: {summary['failed']}")
                continue
            mine = steady_steps(summary)
            steps[who] += mine
            if mine:
                per_round[who].append(statistics.median(mine))
    if any(not v for v in steps.values()):
        return {"same_plan": False, "ratio": None, "rounds": rounds, "failed": failed, "same_as": alias}
    median = {who: statistics.median(v) for who, v in steps.items()}
    med = {who: median[alias.get(who, who)] for who in named}
    out = {"same_plan": len(runs) == 1 or "fastest" in alias, "rounds": rounds, "same_as": alias,
           "order": list(runs), "median_ms": med, "steps_ms": steps, "round_medians_ms": per_round,
           "vs": {who: round(med["autotune"] / med[who], 4) for who in named if who != "autotune"},
           "rerun_spread": {who: round(max(v) / min(v) - 1, 4) for who, v in per_round.items() if len(v) > 1},
           "autotune_ms": med["autotune"], "fastest_ms": med["fastest"],
           "ratio": round(med["autotune"] / med["fastest"], 3), "failed": failed}
    out["autotune_steps"], out["fastest_steps"] = steps[alias.get("autotune", "autotune")], \
        steps[alias.get("fastest", "fastest")]
    return out


def autotune_summary(rows: Sequence[dict], within: float = 0.03) -> dict:
    """Per group: autotune's measured step against the fastest strategy's (paired where it ran: the
    aim is judged on it), the final model's median |error| over the runs autotune made."""
    groups = []
    for model, hosts in dict.fromkeys((r["model"], r["hosts"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["hosts"]) == (model, hosts)]
        tuned = next((r for r in mine if r["strategy"] == "autotune" and r.get("measured_step_ms")), None)
        best = fastest_strategy(mine)
        if tuned is None or best is None:
            continue
        ratio = tuned["measured_step_ms"] / best["measured_step_ms"]
        pair = tuned["autotune"].get("paired") or {}
        judged = pair.get("ratio") if pair.get("ratio") is not None else ratio
        errors = [abs(t["error_final"]) for t in tuned["autotune"]["trials"] if t.get("error_final") is not None]
        groups.append({"model": model, "hosts": hosts, "autotune_ms": tuned["measured_step_ms"],
                       "fastest_strategy": best["strategy"], "fastest_strategy_ms": best["measured_step_ms"],
                       "vs_fastest": round(ratio, 3), "vs_fastest_paired": pair.get("ratio"),
                       "fastest_or_within": judged <= 1 + within, "runs": tuned["autotune"]["runs"],
                       "error_final": tuned["autotune"]["error_final"],
                       "median_abs_error_final_runs": statistics.median(errors) if errors else None,
                       "stop_reason": tuned["autotune"]["stop_reason"]})
    errors = sorted(abs(t["error_final"]) for r in rows if r["strategy"] == "autotune" and r.get("autotune")
                    for t in r["autotune"]["trials"] if t.get("error_final") is not None)
    return {"groups": groups, "within": within, "groups_fastest_or_within": sum(g["fastest_or_within"] for g in groups),
            "median_abs_error_final": statistics.median(errors) if errors else None,
            "runs_with_error_final": len(errors)}
