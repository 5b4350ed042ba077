"""One model x hosts group of ``benchmarks/plans.py``: calibrate the profile's compute times for the
emulated hosts, partition with every strategy, train each distinct plan (and autotune)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import REPO, log
from benchmarks.contention import measure_compute
from benchmarks.plans_analysis import (
    busy_aware_prediction,
    compute_scale,
    memory_refusal,
    plan_key,
    row_from,
    scale_profile,
)
from benchmarks.plans_autotune import autotune_row, fastest_strategy, paired_comparison
from benchmarks.plans_steps import LAUNCH_TIMEOUT_S, MODELS, hybridpipe_cli, partition, train_plan
from hybridpipe.jsonfile import read_json, write_json

PAIRED_WITH = ("uniform", "optimal")   # besides the fastest strategy, autotune's plan is paired with these


def run_model_hosts(cluster, name: str, hosts: int, strategies: list[str], args, work: Path, profile: Path,
                    compute: dict[int, dict], calibrations: list[Path], calib: dict, port_base: int) -> list[dict]:
    """Calibrate ``name``'s profile for ``hosts`` emulated hosts, partition with every strategy, train.

    ``compute``: copies -> measure_compute() result, filled here for ``hosts`` copies (one per
    host) and, without CPU quotas, 2 and hosts/2."""
    spec, batch, _ = MODELS[name]
    raw = read_json(profile, "profile")
    node_sum = raw["totals"]["forward_ms"] + raw["totals"]["backward_ms"]
    wanted = {hosts} if cluster.cpus else {2, hosts // 2, hosts}
    for copies in sorted(wanted - set(compute)):
        compute[copies] = measure_compute(spec, batch, copies, args.contention_seconds, cluster=cluster)
    alone, contended = compute[1], compute[hosts]
    curve = {k: v["median_ms"] / alone["median_ms"] for k, v in compute.items() if k <= hosts}
    if cluster.cpus:            # quotas: alone and all at once measure the same speed; pool them
        contended = {**contended, **{key: (alone[key] + contended[key]) / 2 for key in ("median_ms", "sgd_step_ms")}}
    scale = compute_scale(node_sum, alone["median_ms"], contended["median_ms"])
    calib.update({"hosts": hosts, "node_sum_ms": node_sum, "alone_ms": alone["median_ms"],
                  "contended": contended, **scale, "contention_curve": {str(k): round(v, 3) for k, v in curve.items()},
                  "measurements": {str(k): compute[k] for k in sorted(curve)}})
    log.info("%s on %d hosts: per-node sum %.0f ms, alone %.0f ms, %d at once %.0f ms -> scale %.2f "
             "(isolation %.2f x contention %.2f)", name, hosts, node_sum, alone["median_ms"], hosts,
             contended["median_ms"], scale["scale"], scale["isolation"], scale["contention"])
    scaled = work / f"{name}.x{hosts}.profile.json"
    step = raw["totals"].get("sgd_step_ms") or 0.0
    opt_scale = contended["sgd_step_ms"] / step if step > 0 else None
    calib["optimizer_scale"] = opt_scale
    write_json(scaled, scale_profile(raw, scale["scale"], f"compute x{scale['scale']:.3f}, optimizer steps "
                                     f"x{opt_scale or 0:.3f} for {hosts} emulated hosts on this machine: measured by "
                                     "benchmarks/plans.py (all hosts at once / profile)", opt_scale))
    cluster_file = REPO / "examples" / "clusters" / f"{hosts}x1gbit.json"
    rows, done = [], {}
    for k, strategy in enumerate(strategies):
        plan_file = work / f"{name}.{hosts}.{strategy}.plan.json"
        plan = partition(scaled, cluster_file, strategy, plan_file, calibrations)
        if "refused" in plan:
            rows.append({"model": name, "hosts": hosts, "strategy": strategy, "status": "partition refused",
                         "reason": plan["refused"]})
            log.info("  %-9s partition refused: %s", strategy, plan["refused"].splitlines()[-1])
            continue
        key = plan_key(plan)
        if key in done:
            first = done[key]
            row = {**first, "strategy": strategy, "same_plan_as": first["strategy"]}
            rows.append(row)
            log.info("  %-9s same plan as %s", strategy, first["strategy"])
            continue
        why = memory_refusal(plan)
        summary = {"not_run": why} if why else train_plan(
            cluster, plan_file, work / f"run-{name}-{hosts}-{strategy}", args.steps, port_base + k, args.timeout,
            args.trace, work / f"capture-{name}")
        busy = None if cluster.cpus else busy_aware_prediction(plan, curve, hosts, calibrations)
        row = row_from(name, hosts, strategy, plan, summary, busy)
        done[key] = row
        rows.append(row)
        if row.get("status") == "ok":
            log.info("  %-9s %-28s predicted %6.0f ms, measured %6.0f ms (%+.0f%%), %.1f samples/s, %.0f s",
                     strategy, row["layout"][:28], row["predicted_step_ms"], row["measured_step_ms"],
                     100 * row["error"], row["samples_per_s"], row["run_wall_s"])
        else:
            log.info("  %-9s %s: %s", strategy, row["status"], row["reason"])
    if args.autotune:
        traced = [work / f"run-{name}-{hosts}-{r['strategy']}" for r in rows if args.trace and r.get("status") == "ok"
                  and not r.get("same_plan_as")]       # autotune refines from the strategies' runs (--runs)
        row = autotune_row(hybridpipe_cli, cluster, name, hosts, args, work, scaled, cluster_file, calibrations,
                           port_base + 9, LAUNCH_TIMEOUT_S, work / f"capture-{name}", earlier=traced)
        best = fastest_strategy(rows)
        if args.pair_rounds and row.get("status") == "ok" and best is not None:
            others = {s: work / f"{name}.{hosts}.{s}.plan.json" for s in PAIRED_WITH
                      if any(r["strategy"] == s and r.get("status") == "ok" for r in rows)}
            row["autotune"]["paired"] = paired_comparison(
                lambda plan, run_dir: train_plan(cluster, plan, run_dir, args.autotune_steps, port_base + 8,
                                                 args.timeout, args.trace, work / f"capture-{name}"),
                work / f"autotune-{name}-{hosts}" / "plan.json", work / f"{name}.{hosts}.{best['strategy']}.plan.json",
                work / f"pairs-{name}-{hosts}", args.pair_rounds, others)
            log.info("  autotune vs %s, alternately %d x each: %s", best["strategy"], args.pair_rounds,
                     row["autotune"]["paired"].get("ratio"))
        rows.append(row)
        tuned = row.get("autotune", {})
        if row.get("status") == "ok":
            log.info("  %-9s %-28s measured %6.0f ms after %d run(s) (%s); final model's error %+.1f%%",
                     "autotune", row["layout"][:28], row["measured_step_ms"], tuned["runs"], tuned["stop_reason"],
                     100 * (tuned["error_final"] or 0))
        else:
            log.info("  autotune  %s: %s", row.get("status"), row.get("reason"))
    return rows
