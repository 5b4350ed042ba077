"""Reproduction 4 (seed 003, PipeDream): the plans of every partitioning strategy, trained on
emulated hosts at 1 Gbit/s, measured against the partitioner's prediction.

For each model and host count: profile the model (one process, one thread, as each worker
runs), calibrate the profile's compute times for the emulated hosts by measurement (below),
make the plan of every strategy (``hybridpipe partition --strategy S`` with
``examples/clusters/<n>x1gbit.json``), train each distinct plan a few steps with
``launch.py`` under multi-node torchrun on ``n`` emulated hosts, and read the median step time
from its ``summary.json`` next to the plan's prediction. Strategies whose plans are identical
(same stages, replicas, ranks, schedule and per-layer all-reduce) are run once and say so.

CPU: the n emulated hosts share this machine's cores. By default each host gets its own share,
``cores / n`` (``--cpus-per-host``, a CPU quota per host: ``tools/emucluster/cpu.py``), so a host
computes and communicates at the same speed whatever the others do, as on a real cluster;
``--cpus-per-host none`` lets them share the cores freely (then a pipeline's idle hosts lend
their cores to the busy ones, which the partitioner does not model).

Calibration (``compute_scale`` in plans_analysis.py, ``measure_compute`` in contention.py): each
worker computes slower than the profile says. Measured, not assumed: one full
forward+loss+backward at the profile's batch (one thread) is timed alone on host 0, then on
every host at once (with quotas the two agree within a few per cent; without, the contention
curve at 2, n/2 and n copies is kept too). The profile's node times are scaled by all-at-once /
per-node sum, which also corrects what timing nodes one by one misses; the profile's optimizer
step times are scaled by the sgd step measured the same way. The plans are made from the scaled
profile. Without quotas, each plan's prediction is also re-simulated "busy-aware" (compute
slowed by the contention of the workers that compute at once, from the measured curve). The partitioner also gets
``--calibration`` from ``hybridpipe bench-allreduce`` run on the same emulated cluster just before
(every algorithm, 64 KiB..64 MiB; ``--no-allreduce-calibration`` skips it).

Sizes are reduced so that n workers on 2 cores stay in proportion to 1 Gbit/s (see MODELS):
parameters (and so all-reduce and memory) are the full models' except where noted.

    sudo flock /tmp/hybridpipe-bench.lock .venv/bin/python benchmarks/plans.py --quick
    sudo flock /tmp/hybridpipe-bench.lock .venv/bin/python benchmarks/plans.py --quick --cpus-per-host none
    sudo .venv/bin/python benchmarks/plans.py --lock /tmp/hybridpipe-bench.lock   # the lock per model x hosts

Each model x hosts group (its profile on first use, the all-reduce calibration on the first group
of a cluster, the contention measurements and every plan's run) is measured side by side, under
the lock when ``--lock`` is given; ratios are taken within a group only.

Autotune (issue 18): after the strategies, each group runs ``hybridpipe autotune`` on the same
scaled profile, cluster file and calibration, its job command being ``python -m tools.emucluster
torchrun --name <this cluster> -- launch.py --plan {plan} --steps {steps} --run-dir {run_dir}``
(with the timeline on: refinement reads it); at most ``--autotune-budget`` runs. Its row
(strategy ``autotune``) is the plan it chose, measured in its own run, with the prediction of
the final refined model (``autotune.error_final``), the runs it took and why it stopped;
``--no-autotune`` leaves it out.

Writes benchmarks/results/plans[_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    REPO,
    bench_lock,
    log,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    setup_logging,
    write_results,
)
from benchmarks.contention import measure_compute
from benchmarks.plans_analysis import (
    STRATEGIES,
    add_relative,
    busy_aware_prediction,
    compute_scale,
    error_summary,
    memory_refusal,
    plan_key,
    plot,
    refusal_lines,
    row_from,
    scale_profile,
)
from benchmarks.plans_autotune import autotune_row, autotune_summary, fastest_strategy, paired_comparison
from hybridpipe.jsonfile import read_json, write_json

# name -> (model spec, samples per micro-batch, what was reduced)
MODELS = {
    "alexnet": ("alexnet[image=64]", 32, "input 3x64x64 (paper 224); the adaptive pool keeps fc1 at 9216 inputs, "
                "so all 62.4M parameters are kept"),
    "vgg16": ("vgg16[image=32]", 4, "input 3x32x32 (paper 224), batch 4; the adaptive pool keeps fc1 at 25088 "
              "inputs, so all 138.4M parameters are kept"),
    "resnet50": ("resnet50[image=64]", 8, "input 3x64x64 (paper 224), batch 8; all 25.6M parameters kept"),
    "gpt": ("gpt", 8, "the zoo's small GPT (4 layers, width 256, seq 128, vocab 2048; 4.2M parameters), batch 8"),
}
QUICK_MODELS, QUICK_HOSTS = "alexnet,gpt", "4"
LAUNCH_TIMEOUT_S = 120       # launch.py --timeout: any receive / collective


# ---- profile, calibrate, partition ---------------------------------------------------------

def hybridpipe_cli(args: Sequence[str], timeout_s: float = 600,
                   threads: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-m", "hybridpipe.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def profile_model(name: str, work: Path, repeats: int) -> Path:
    spec, batch, _ = MODELS[name]
    out = work / f"{name}.profile.json"
    r = hybridpipe_cli(["profile", spec, "-b", str(batch), "--repeats", str(repeats), "-q", "-o", str(out)], threads=1)
    if r.returncode:
        raise RuntimeError(f"profiling {spec} failed:\n{r.stderr[-2000:]}")
    return out


def partition(profile: Path, cluster_file: Path, strategy: str, out: Path, calibrations: Sequence[Path]) -> dict:
    """The plan dict, or {"refused": message} when the partitioner refuses."""
    cmd = ["partition", str(profile), "--cluster", str(cluster_file), "--strategy", strategy, "-o", str(out)]
    for c in calibrations:
        cmd += ["--calibration", str(c)]
    r = hybridpipe_cli(cmd, timeout_s=300)
    if r.returncode:
        return {"refused": (r.stderr.strip() or r.stdout.strip())[-1000:]}
    return read_json(out, "plan")


def allreduce_calibration(cluster, out: Path, timeout_s: float) -> Path:
    """``hybridpipe bench-allreduce`` on every host of the emulated cluster (level ``network``)."""
    from benchmarks.common import worker_env
    cluster.run([sys.executable, "-m", "hybridpipe.cli", "bench-allreduce", "-o", str(out), "--level", "network",
                 "--sizes", "64K..64M", "--size-step", "4", "--reps", "3", "--budget", "0.2", "--no-progress"],
                timeout_s=timeout_s, env=lambda h: worker_env(cluster, h), cwd=REPO)
    return out


def link_fits(calibration_file: Path) -> dict[str, dict[str, float]]:
    """Per algorithm (and p2p) of a calibration: fitted per-step latency (us) and bandwidth (Gbit/s)."""
    from hybridpipe.partitioner.cost.calibration import load_calibration
    cal = load_calibration(calibration_file)
    fits = {"p2p": cal.p2p, **cal.algorithms} if cal.p2p else dict(cal.algorithms)
    out = {name: {"alpha_us": round(f.alpha_s * 1e6, 1), "gbps": round(8e-9 / f.beta_s_per_byte, 3)
                  if f.beta_s_per_byte > 0 else None, "fit_error": round(f.rel_error, 3)}
           for name, f in fits.items()}
    return {**out, "interference_ms_per_mb": round(cal.interference_s_per_byte * 1e9, 3),
            "overlap_slowdown": round(cal.overlap_slowdown, 3)}


# ---- training a plan on the emulated hosts ---------------------------------------------------

def train_plan(cluster, plan_file: Path, run_dir: Path, steps: int, port: int, timeout_s: float,
               trace: bool = False) -> dict:
    """Run launch.py on every emulated host; the summary.json, or {"failed": message}."""
    from tools.emucluster.errors import HostCommandFailed
    t = time.monotonic()
    try:
        cluster.torchrun(["launch.py", "--plan", str(plan_file), "--steps", str(steps), "--run-dir", str(run_dir),
                          *([] if trace else ["--no-trace"]), "--no-progress", "--timeout", str(LAUNCH_TIMEOUT_S)],
                         timeout_s=timeout_s, port=port, cwd=REPO,
                         env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    except HostCommandFailed as e:
        return {"failed": refusal_lines(str(e)), "wall_s": time.monotonic() - t}
    summary = read_json(run_dir / "summary.json", "summary")
    summary["wall_s"] = time.monotonic() - t
    return summary


# ---- the driver ------------------------------------------------------------------------------

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
            args.trace)
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
        row = autotune_row(hybridpipe_cli, cluster, name, hosts, args, work, scaled, cluster_file, calibrations,
                           port_base + 9, LAUNCH_TIMEOUT_S)
        best = fastest_strategy(rows)
        if args.pair_rounds and row.get("status") == "ok" and best is not None:
            row["autotune"]["paired"] = paired_comparison(
                lambda plan, run_dir: train_plan(cluster, plan, run_dir, args.autotune_steps, port_base + 8,
                                                 args.timeout),
                work / f"autotune-{name}-{hosts}" / "plan.json", work / f"{name}.{hosts}.{best['strategy']}.plan.json",
                work / f"pairs-{name}-{hosts}", args.pair_rounds)
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


def settings_dict(models: Sequence[str], hosts: Sequence[int], strategies: Sequence[str], steps: int, repeats: int,
                  lock: str | None, allreduce_calibration: bool, cpus: str = "auto") -> dict:
    """What a run did, for the results JSON."""
    return {"models": {m: {"spec": MODELS[m][0], "batch_per_micro_batch": MODELS[m][1], "reduced": MODELS[m][2]}
                       for m in models},
            "hosts": list(hosts), "rate": "1gbit (tools/emucluster, tc tbf, MTU 1500, no added latency)",
            "cpus_per_host": {h: cpus_per_host(cpus, h) for h in hosts},
            "cluster_files": [f"examples/clusters/{h}x1gbit.json" for h in hosts],
            "strategies": list(strategies), "steps": steps, "threads_per_worker": 1, "lock_per_group": lock,
            "launch": "torchrun --nnodes N --nproc-per-node 1 (c10d) launch.py --plan P --steps S "
                      f"--no-trace --timeout {LAUNCH_TIMEOUT_S}; schedule (1f1b), micro-batches (2 per worker), "
                      "all-reduce (hybrid: per layer as the plan says) and p2p mode (sa) are the defaults",
            "measured_step": "launch.py summary.json: median of the slowest rank's step time over the steps after "
                             "the warm-up (first fifth, at least 1)",
            "calibration_method": f"profile: hybridpipe profile, 1 thread, --repeats {repeats}; compute scale = "
                                  "(median forward+loss+backward of one copy while N copies run at once, one per "
                                  "emulated host, 1 thread each) / (profile's per-node sum); every node's "
                                  "forward/backward multiplied by it (with CPU quotas: the mean of alone and all at "
                                  "once); optimizer step times scaled by the sgd step measured alike; "
                                  "plans made from the scaled profile (predicted_step_ms). "
                                  "busy-aware (no quotas): the plan "
                                  "re-simulated with compute scaled by c(B)/c(N), c measured at 1, 2, N/2, N copies, "
                                  "B = compute concurrency of the simulated schedule (predicted_busy_step_ms)",
            "allreduce_calibration": "hybridpipe bench-allreduce on the emulated cluster (every algorithm, 64K..64M), "
                                     "passed to partition --calibration" if allreduce_calibration else "none"}


def cpus_per_host(option: str, hosts: int) -> float | None:
    """``--cpus-per-host``: ``auto`` = this machine's cores / hosts, ``none`` = no quota, else a number."""
    if option == "none":
        return None
    return (os.cpu_count() or 1) / hosts if option == "auto" else float(option)


def replot(json_path: Path) -> None:
    """Redraw the PNG of a results JSON; a partial one (a run stopped between groups) also gets its
    ratios and error summary filled in, and keeps ``"partial": true``."""
    data = read_json(json_path, "results")
    rows = add_relative(data["rows"])
    if data.get("partial"):
        models = list(dict.fromkeys(r["model"] for r in rows))
        data.setdefault("settings", settings_dict(models, sorted({r["hosts"] for r in rows}), STRATEGIES, 3, 3,
                                                  "/tmp/hybridpipe-bench.lock", True))
        data.setdefault("machine", machine())
        data["note"] = ("partial: the run was stopped after the groups in compute_calibration; settings are the "
                        "defaults of `benchmarks/plans.py --lock /tmp/hybridpipe-bench.lock`; machine as at replot")
        data["errors"] = {"plan": error_summary(rows), "busy_aware": error_summary(rows, key="error_busy")}
        write_json(json_path, data)
    models = list(dict.fromkeys(r["model"] for r in rows))
    hosts = sorted({r["hosts"] for r in rows})
    fig = plot(pyplot(), rows, _title(models, hosts, data.get("settings", {}).get("cpus_per_host")))
    fig.savefig(json_path.with_suffix(".png"), dpi=110, bbox_inches="tight")


def _title(models: Sequence[str], hosts: Sequence[int], cpus: dict | None = None) -> str:
    """``cpus``: hosts -> cores per host (None: no quota), as in the results' settings."""
    quota = [f"{c:g}" for c in (cpus or {}).values() if c]
    share = f"a CPU quota of {'/'.join(quota)} cores per host" if quota else "hosts sharing the cores freely"
    return (f"partition strategies trained on emulated hosts at 1 Gbit/s ({', '.join(models)}; "
            f"{'/'.join(map(str, hosts))} hosts; 1 thread per worker; {share})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"models {QUICK_MODELS} on {QUICK_HOSTS} hosts")
    p.add_argument("--models", default=None, help=f"from {','.join(MODELS)} (default all; quick {QUICK_MODELS})")
    p.add_argument("--hosts", default=None, help="emulated host counts, from 4,8 (default 4,8; quick 4)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"from {','.join(STRATEGIES)} (default all)")
    p.add_argument("--steps", type=int, default=None, help="training steps per plan, the first fifth (at least 1) "
                   "is warm-up (default 3: the median of the last 2)")
    p.add_argument("--repeats", type=int, default=3, help="profile repeats per node (default 3)")
    p.add_argument("--contention-seconds", type=float, default=None, help="seconds of each compute-only "
                   "contention measurement (default 8; quick 5)")
    p.add_argument("--no-allreduce-calibration", dest="allreduce_calibration", action="store_false",
                   help="partition with the cluster file's nominal link figures only (default: run hybridpipe "
                   "bench-allreduce on each emulated cluster first and partition with its calibration)")
    p.add_argument("--cpus-per-host", default="auto", help="cores each emulated host may use: a number, auto "
                   "(this machine's cores / hosts, the default) or none (no quota: hosts share the cores freely)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per training run (default 420)")
    p.add_argument("--lock", default=None, metavar="PATH",
                   help="take this flock around each model x hosts group (e.g. /tmp/hybridpipe-bench.lock), so "
                   "other timing runs can go between groups; do not also wrap the command in flock on the same file")
    p.add_argument("--no-autotune", dest="autotune", action="store_false",
                   help="leave out the autotune row of each group (hybridpipe autotune on the same cluster)")
    p.add_argument("--autotune-budget", type=int, default=4, help="autotune's runs per group (default 4)")
    p.add_argument("--pair-rounds", type=int, default=2, help="after autotune, run its plan and the fastest "
                   "strategy's alternately N times each (default 2; 0: no paired comparison)")
    p.add_argument("--autotune-steps", type=int, default=6, help="steps of each autotune run (default 6: the "
                   "first is warm-up, its median and noise from the other 5; re-measures pool their steps)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the result files (plans_<tag>[_quick])")
    p.add_argument("--trace", action="store_true", help="record the strategies' runs' timelines too (for "
                   "hybridpipe partition --refine; default --no-trace: autotune's runs always record theirs)")
    p.add_argument("--work", default=None, metavar="DIR", help="keep profiles, plans and run directories "
                   "(autotune's with their timelines) in DIR (default: a temporary folder, removed)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a results JSON (next to it)")
    args = p.parse_args(argv)
    if args.replot:
        replot(Path(args.replot))
        return 0
    quick = args.quick
    models = (args.models or (QUICK_MODELS if quick else ",".join(MODELS))).split(",")
    hosts_list = [int(h) for h in (args.hosts or (QUICK_HOSTS if quick else "4,8")).split(",")]
    strategies = args.strategies.split(",")
    bad = [m for m in models if m not in MODELS] + [s for s in strategies if s not in STRATEGIES]
    bad += [str(h) for h in hosts_list if not (REPO / "examples" / "clusters" / f"{h}x1gbit.json").exists()]
    if bad:
        raise SystemExit(f"unknown model/strategy/host count {bad}; models {','.join(MODELS)}, strategies "
                         f"{','.join(STRATEGIES)}, hosts with a cluster file examples/clusters/<n>x1gbit.json")
    if "optimal" not in strategies:
        strategies.insert(0, "optimal")           # the reference of every ratio
    args.steps = args.steps or 3
    args.contention_seconds = args.contention_seconds or (5.0 if quick else 8.0)
    setup_logging()
    require_emulation()
    json_path, png_path = result_paths("plans" + (f"_{args.tag}" if args.tag else ""), quick, args.out)
    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows, calibration, links = [], [], {}
    from tools.emucluster import EmulatedCluster
    with tempfile.TemporaryDirectory(prefix="hp-plans-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        profiles: dict[str, Path] = {}
        for hosts in hosts_list:
            with EmulatedCluster(hosts, rate="1gbit", cpus=cpus_per_host(args.cpus_per_host, hosts)) as cluster:
                calibrations: list[Path] = []
                for m, name in enumerate(models):
                    with bench_lock(args.lock) as waited:
                        calib = {"model": name, "hosts": hosts, "lock_wait_s": waited,
                                 "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
                        if name not in profiles:
                            profiles[name] = profile_model(name, work, args.repeats)
                        if args.allreduce_calibration and not calibrations:
                            calibrations = [allreduce_calibration(cluster, work / f"allreduce{hosts}.json",
                                                                  args.timeout)]
                            links[str(hosts)] = link_fits(calibrations[0])
                            log.info("all-reduce calibration on %d hosts: %s; compute lost to communication "
                                     "%.3f ms/MB; all-reduce beside compute %.2fx", hosts, ", ".join(
                                         f"{a} {f['gbps']:.2f} Gbit/s + {f['alpha_us']:.0f} us"
                                         for a, f in links[str(hosts)].items() if isinstance(f, dict)),
                                     links[str(hosts)]["interference_ms_per_mb"], links[str(hosts)]["overlap_slowdown"])
                        compute = {1: measure_compute(MODELS[name][0], MODELS[name][1], 1, args.contention_seconds,
                                                      cluster=cluster)}
                        rows += run_model_hosts(cluster, name, hosts, strategies, args, work, profiles[name], compute,
                                                calibrations, calib, port_base=29400 + 10 * m)
                        calib["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
                    calibration.append(calib)
                    write_json(json_path, {"benchmark": "plans", "partial": True, "rows": rows,
                                           "compute_calibration": calibration, "allreduce_calibration_fits": links})
    add_relative(rows)
    data = {"benchmark": "plans", "quick": quick, "machine": machine(), "load_average_before": load_before,
            "settings": settings_dict(models, hosts_list, strategies, args.steps, args.repeats, args.lock,
                                      args.allreduce_calibration, args.cpus_per_host),
            "compute_calibration": calibration, "allreduce_calibration_fits": links, "rows": rows,
            "errors": {"plan": error_summary(rows), "busy_aware": error_summary(rows, key="error_busy")},
            "autotune": autotune_summary(rows), "duration_s": round(time.monotonic() - started, 1)}
    write_results(json_path, data, plot(pyplot(), rows, _title(models, hosts_list, data["settings"]["cpus_per_host"])),
                  png_path)
    for what, e in data["errors"].items():
        log.info("%s prediction within %.0f%% for %d of %d runs (median |error| %s)", what, 100 * e["goal"],
                 e["within_goal"], e["runs"], f"{100 * e['median_abs_error']:.0f}%"
                 if e["median_abs_error"] is not None else "-")
    for g in data["autotune"]["groups"]:
        log.info("autotune %s on %d hosts: %.0f ms, %.3fx the fastest strategy (%.0f ms), %d run(s), final model's "
                 "error %s", g["model"], g["hosts"], g["autotune_ms"], g["vs_fastest"], g["fastest_strategy_ms"],
                 g["runs"], f"{100 * g['error_final']:+.1f}%" if g["error_final"] is not None else "-")
    log.info("done in %.0f s", data["duration_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
