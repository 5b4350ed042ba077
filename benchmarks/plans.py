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

Sizes are reduced so that n workers on 2 cores stay in proportion to 1 Gbit/s (see MODELS in plans_steps.py):
parameters (and so all-reduce and memory) are the full models' except where noted.

The steps (profile, partition, calibrate, train: plans_steps.py) and one model x hosts group
(plans_group.py) live beside this driver.

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
``--no-autotune`` leaves it out. With ``--trace`` autotune is given the strategies' runs
(``--runs``): it refines from them before its first choice.

Writes benchmarks/results/plans[_quick].{json,png}.
"""

from __future__ import annotations

import argparse
import os
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
    LAYER_STRATEGIES,
    STRATEGIES,
    add_relative,
    error_summary,
    plot,
    strategy_args,
)
from benchmarks.plans_autotune import autotune_summary
from benchmarks.plans_group import run_model_hosts
from benchmarks.plans_steps import LAUNCH_TIMEOUT_S, MODELS, allreduce_calibration, link_fits, profile_model
from hybridpipe.jsonfile import read_json, write_json

QUICK_MODELS, QUICK_HOSTS = "alexnet,gpt", "4"


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


def known_strategy(name: str) -> bool:
    try:
        strategy_args(name)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"models {QUICK_MODELS} on {QUICK_HOSTS} hosts")
    p.add_argument("--models", default=None, help=f"from {','.join(MODELS)} (default all; quick {QUICK_MODELS})")
    p.add_argument("--hosts", default=None, help="emulated host counts, from 4,8 (default 4,8; quick 4)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"from {','.join(STRATEGIES + LAYER_STRATEGIES)} (default {','.join(STRATEGIES)}; a layer "
                   "strategy is refused on a model without a layer stack), or S@N: baseline S on N stages of "
                   "hosts/N replicas each (hybrid layouts; S one of uniform, params, torchtitan, megatron)")
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
    p.add_argument("--autotune-steps", type=int, default=None, help="steps of each autotune run and paired run "
                   "(default the larger of 6 and --steps: the first fifth, at least 1, is warm-up, then the leading "
                   "steps still warming up (observed.settling_steps); re-measures pool their steps. Runs as long as "
                   "the strategies' keep the same plan's reruns comparable: the Llama's 6-step runs of pred7 held "
                   "one warm-up step in 5, RESULTS 4e)")
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
    bad = [m for m in models if m not in MODELS] + [s for s in strategies if not known_strategy(s)]
    bad += [str(h) for h in hosts_list if not (REPO / "examples" / "clusters" / f"{h}x1gbit.json").exists()]
    if bad:
        raise SystemExit(f"unknown model/strategy/host count {bad}; models {','.join(MODELS)}, strategies "
                         f"{','.join(STRATEGIES)}, hosts with a cluster file examples/clusters/<n>x1gbit.json")
    if "optimal" not in strategies:
        strategies.insert(0, "optimal")           # the reference of every ratio
    args.steps = args.steps or 3
    args.autotune_steps = args.autotune_steps or max(6, args.steps)
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
