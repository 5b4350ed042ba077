"""Framework overhead per instruction: hybridpipe's engine vs ``torch.distributed.pipelining``.

    python benchmarks/overhead.py                        # mlp of 16 tiny layers, 4 stages, 1f1b and gpipe
    python benchmarks/overhead.py --quick                # fewer steps, one round
    python benchmarks/overhead.py --schedules 1f1b --model 'mlp[features=8,hidden=8,layers=32]'
    python benchmarks/overhead.py --quick --alternations 8   # 8 short ABBA pairs: ratios with their spread

Stages of tiny layers (default ``mlp[features=8,hidden=8,layers=16]``, micro-batches of 2
samples) on ``--stages`` local processes over gloo on loopback, one thread each: the compute is
a few microseconds per micro-batch, so what a step costs is the frameworks' own work. Both
systems run the same stages (``vs_torch_pipelining.make_plan``'s compute-balanced cut; torch's
side is ``torch_side.build_theirs``: the same GraphModules in torch's ``PipelineStage``) and the
same schedule: ours ``1f1b`` / ``gpipe`` through the Trainer (channels ``sa``, the engine, the
loss watch), torch's ``Schedule1F1B`` / ``ScheduleGPipe`` + ``optimizer.step``.

Method. Every rank wraps each instruction in a *probe* (overhead_probes.py) that adds the
calling thread's CPU time (``time.thread_time``) to its kind: forward (ours Forward + Loss;
torch ``forward_one_chunk`` + the schedule's loss), backward (Backward; ``backward_one_chunk``),
send (SendActivations/SendGradients; torch: building the send ops, its share of posting the
batched ops and of waiting for them), recv (likewise), data (loading a micro-batch, its target),
step (the optimizer step and zeroing). A step's thread CPU outside every probe is *dispatch*
(the schedule's own loop). Waiting in a blocking receive costs no thread CPU, so these are costs,
not latencies. The process's CPU time per step (``time.process_time``, every thread) minus the
step thread's is the *background* CPU: our per-peer send/receive threads, gloo's own threads.
The *baseline* is the same stage modules' forward and backward in plain PyTorch in one process
(no framework); an instruction's overhead is its CPU minus the baseline's, and the headline,
``framework CPU per instruction``, is (every rank's process CPU per step - its data loading -
the baseline's compute per step) / (the step's forward, backward, send and receive
instructions), summed over ranks (data loading is the benchmark's synthetic data set, not a
framework's work: torch's side loads each step's global batch on every rank, ours a
micro-batch where a stage reads it). The probes cost both sides the same (a ``thread_time`` pair per call, ~1 us).
Send and receive are also charged every thread: ``comm_all_threads_us_per_instruction`` is their probes'
CPU plus every other thread's (gloo's loop threads, our receive / send threads) per send or receive, so
where a frame is written (gloo writes it on the caller's thread when the peer's receive is posted, else
on its loop thread) does not matter. Torch's gradient scaling (``perform_reduce_grad``: a ``div_`` per
gradient) is charged to its step, as ours is to our Step (or to the backward's seed).

Runs alternate in one invocation (``--alternations`` / ``--rounds`` K: ours, torch, torch, ours, ...,
each a short run), so drift of the machine hits both; per measure, ``paired_ratios`` holds each round's
ours / torch, their median, quartiles and a 95% bootstrap interval of the median, and a verdict
(lighter / heavier where the interval is clear of 1). Medians over rounds as before. Then one counting
run per system (overhead_counts.py; ``--no-counts`` skips it): Python calls, C calls and aten ops per
instruction of each kind, load-independent. Results: ``benchmarks/results/overhead[_TAG][_quick].json``
and ``.png``, with the machine's load at each run's start and at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, pyplot, result_paths, setup_logging, write_results  # noqa: E402
from benchmarks.overhead_probes import KINDS, baseline, ours_rank, theirs_rank  # noqa: E402
from benchmarks.overhead_stats import measures, paired  # noqa: E402
from benchmarks.vs_torch_pipelining import make_plan  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.partitioner.plan import load_plan, save_plan  # noqa: E402

TORCH_CLASS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
INSTRUCTIONS = ("forward", "backward", "send", "recv")


def run_system(system: str, plan_path: Path, stages: int, steps: int, warmup: int, count: bool = False) -> list[dict]:
    """Every rank's totals (overhead_probes.run_steps) of one run of ``system`` (``ours-S`` / ``torch-S``);
    with ``count``, a run that counts Python calls and aten ops (overhead_counts.py)."""
    who, schedule = system.split("-", 1)
    if who == "ours":
        outcomes = run_local(ours_rank, stages, str(plan_path), steps, warmup, count, timeout_s=600,
                             pg_timeout_s=120)
    else:
        outcomes = run_local(theirs_rank, stages, str(plan_path), steps, warmup, TORCH_CLASS[schedule], count,
                             timeout_s=600, pg_timeout_s=120)
    if problems := describe_failures(outcomes):
        raise RuntimeError(problems)
    return [o.value for o in sorted(outcomes, key=lambda o: o.rank)]


def per_run(ranks: list[dict], base: list[dict[str, float]], micro_batches: int) -> dict:
    """One run's microseconds: per instruction kind (CPU per call, and minus the baseline for
    forward/backward), per step (dispatch, background, process CPU), framework CPU per instruction."""
    cpu = {k: sum(r["cpu_s"].get(k, 0.0) for r in ranks) for k in KINDS}
    count = {k: sum(r["count"].get(k, 0.0) for r in ranks) for k in KINDS}
    steps = ranks[0]["steps"]
    per_call = {k: cpu[k] / count[k] * 1e6 for k in KINDS if count[k]}
    base_fwd = sum(b["forward_s"] for b in base) * micro_batches          # per step, every rank
    base_bwd = sum(b["backward_s"] for b in base) * micro_batches
    probed = sum(cpu.values())
    thread = sum(r["thread_s"] for r in ranks)
    process = sum(r["process_s"] for r in ranks)
    n_ins = sum(count[k] for k in INSTRUCTIONS) / steps
    threads: dict[str, dict[str, float]] = {}
    for r in ranks:
        for label, row in r.get("threads", {}).items():
            into = threads.setdefault(label, dict.fromkeys(row, 0.0))
            for k, v in row.items():
                into[k] += v
    return {
        "us_per_instruction": per_call,
        "overhead_us": {"forward": (cpu["forward"] / steps - base_fwd) / (count["forward"] / steps) * 1e6,
                        "backward": (cpu["backward"] / steps - base_bwd) / (count["backward"] / steps) * 1e6,
                        "send": per_call.get("send", 0.0), "recv": per_call.get("recv", 0.0)},
        "instructions_per_step": {k: count[k] / steps for k in KINDS},
        "dispatch_us_per_step": (thread - probed) / steps * 1e6,
        "background_us_per_step": (process - thread) / steps * 1e6,
        "process_cpu_us_per_step": process / steps * 1e6,
        "wall_ms_per_step": max(r["wall_s"] for r in ranks) / steps * 1e3,
        "framework_cpu_us_per_instruction": ((process - cpu["data"]) / steps - base_fwd - base_bwd) / n_ins * 1e6,
        # send + receive charged every thread: their step-thread CPU and all the other threads' (gloo's
        # loop threads, our receive / send threads), per send or receive; where a frame is written
        # (the caller's thread or gloo's loop thread) then does not matter
        "comm_all_threads_us_per_instruction": (cpu["send"] + cpu["recv"] + process - thread)
        / max(count["send"] + count["recv"], 1) * 1e6,
        "threads_per_step": threads,    # per thread label, every rank: cpu_us, wakeups, preempted, threads
    }


def per_counts(ranks: list[dict]) -> dict:
    """A counting run's Python calls, C calls and aten ops, every rank summed: per instruction of each
    kind (forward, backward, send, recv, data, step) and per step (those, the dispatch outside every
    probe, the background threads), plus the aten ops by name per step."""
    calls = [r["calls"] for r in ranks]
    steps = {"python_calls": calls[0]["steps"]["calls"], "c_calls": calls[0]["steps"]["calls"],
             "aten_ops": calls[0]["steps"]["ops"], "function_names": calls[0]["steps"]["calls"],
             "aten_op_names": calls[0]["steps"]["ops"]}
    per_step = {k: sum(r["count"].get(k, 0.0) for r in ranks) / ranks[0]["steps"] for k in KINDS}
    out: dict = {"per_instruction": {}, "per_step": {}, "instructions_per_step": per_step}
    for what in ("python_calls", "c_calls", "aten_ops"):
        total = {k: sum(c[what].get(k, 0) for c in calls) / steps[what] for k in (*KINDS, "dispatch", "background")}
        out["per_step"][what] = {**total, "all": sum(total.values())}
        out["per_instruction"][what] = {k: total[k] / per_step[k] for k in KINDS if per_step[k]}
        comm = per_step["send"] + per_step["recv"]
        out["per_instruction"][what]["send+recv+background"] = (
            (total["send"] + total["recv"] + total["background"]) / comm if comm else 0.0)
        n_ins = sum(per_step[k] for k in INSTRUCTIONS)
        out["per_instruction"][what]["all, per instruction"] = (sum(total.values()) - total["data"]) / n_ins
    for what in ("aten_op_names", "function_names"):
        names: dict[str, float] = {}
        for c in calls:
            for name, n in c.get(what, {}).items():
                names[name] = names.get(name, 0) + n / steps[what]
        out[f"{what}_per_step"] = dict(sorted(names.items(), key=lambda kv: -kv[1]))
    return out


def median_of(runs: list[dict]) -> dict:
    """The per-key median over rounds of :func:`per_run`'s (nested) numbers."""
    first = runs[0]         # a key some rounds lack (a thread label) is the median of those that have it
    return {k: median_of([r[k] for r in runs if k in r]) if isinstance(v, dict)
            else statistics.median(r[k] for r in runs if k in r) for k, v in first.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp[features=8,hidden=8,layers=16]")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", "--alternations", type=int, default=None, dest="rounds",
                   help="alternations of ours and torch (ABBA), each a short run (default 2; --quick 1)")
    p.add_argument("--no-counts", action="store_true", help="skip the counting runs (Python calls, aten ops)")
    p.add_argument("--count-steps", type=int, default=6, help="steps of a counting run (2 of them warm-up)")
    p.add_argument("--schedules", default="1f1b,gpipe", help="comma-separated: 1f1b, gpipe")
    p.add_argument("--quick", action="store_true", help="12 steps (4 warm-up), one round")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--tag", default="")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    setup_logging(a.verbose)
    if a.quick:
        a.steps, a.warmup = 12, 4
    a.rounds = a.rounds or (1 if a.quick else 2)
    schedules = [s.strip() for s in a.schedules.split(",") if s.strip()]
    if unknown := [s for s in schedules if s not in TORCH_CLASS]:
        raise SystemExit(f"unknown schedule(s) {unknown}; choose from {', '.join(TORCH_CLASS)}")
    tmp = Path(tempfile.mkdtemp(prefix="overhead."))
    make_plan(a.model, a.stages, a.micro_batches, a.batch_size, tmp / "plan.json")
    plan = load_plan(tmp / "plan.json")
    if len(plan.stages) != a.stages:
        raise SystemExit(f"{a.model} splits into {len(plan.stages)} stages, not {a.stages}; give it more layers")
    paths = {}
    for s in schedules:
        paths[s] = tmp / f"plan-{s}.json"
        save_plan(dataclasses.replace(plan, schedule=s), paths[s])
    base = baseline(str(paths[schedules[0]]), repeats=200)
    systems = [f"{who}-{s}" for s in schedules for who in ("ours", "torch")]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(a.rounds):
        for name in systems if r % 2 == 0 else systems[::-1]:
            load = os.getloadavg()[0]
            ranks = run_system(name, paths[name.split("-", 1)[1]], a.stages, a.steps, a.warmup)
            runs[name].append({**per_run(ranks, base, a.micro_batches), "round": r, "load_at_start": load})
            print(f"round {r} {name}: framework {runs[name][-1]['framework_cpu_us_per_instruction']:.1f} "
                  f"us/instruction, load {load:.1f}", flush=True)
    med = {s: median_of([{k: v for k, v in x.items() if k not in ("round", "load_at_start")} for x in v])
           for s, v in runs.items()}
    picks = measures(INSTRUCTIONS, KINDS)
    spread = {s: paired(runs[f"ours-{s}"], runs[f"torch-{s}"], picks) for s in schedules}
    counts = {} if a.no_counts else {
        name: per_counts(run_system(name, paths[name.split("-", 1)[1]], a.stages, a.count_steps, 2, count=True))
        for name in systems}
    result = {
        "benchmark": "overhead", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
        "stages": [[s.first_node, s.last_node] for s in plan.stages], "micro_batches": a.micro_batches,
        "batch_size": a.batch_size, "steps": a.steps, "warmup": a.warmup, "rounds": a.rounds,
        "backend": "gloo", "network": "loopback", "threads_per_process": 1,
        "baseline_us_per_micro_batch": [{k: v * 1e6 for k, v in b.items()} for b in base],
        "runs": runs, "median": med, "paired_ratios": spread, "counts": counts,
        "load_at_end": os.getloadavg(),
        "ours_vs_torch_framework_cpu": {s: med[f"ours-{s}"]["framework_cpu_us_per_instruction"]
                                        / med[f"torch-{s}"]["framework_cpu_us_per_instruction"] for s in schedules},
    }
    json_path, png_path = result_paths("overhead" + (f"_{a.tag}" if a.tag else ""), a.quick, a.out_dir)
    write_results(json_path, result, _figure(result), png_path)
    for s, m in med.items():
        per = m["us_per_instruction"]
        print(f"{s:>12}: " + "  ".join(f"{k} {per.get(k, 0):6.1f}" for k in KINDS) +
              f"  | dispatch {m['dispatch_us_per_step']:7.0f}/step  background {m['background_us_per_step']:7.0f}/step"
              f"  | framework {m['framework_cpu_us_per_instruction']:6.1f} us/instruction"
              f"  wall {m['wall_ms_per_step']:6.2f} ms/step")
    for s, m in med.items():
        rows = sorted(m["threads_per_step"].items(), key=lambda kv: -kv[1]["cpu_us"])
        print(f"{s:>12}: per step, every rank: " + "  ".join(
            f"{label} {row['cpu_us']:.0f} us / {row['wakeups']:.0f} wake-ups ({row['threads']:.0f})"
            for label, row in rows if row["cpu_us"] >= 1))
    for s, by in spread.items():
        for name, row in by.items():
            print(f"{s} ours / torch {name:>40}: median {row['median']:.2f}x  IQR {row['q1']:.2f}-{row['q3']:.2f}  "
                  f"95% CI {row['ci95'][0]:.2f}-{row['ci95'][1]:.2f}  ({len(row['ratios'])} rounds: "
                  f"{row['verdict']})")
    for name, c in counts.items():
        for what, row in c["per_instruction"].items():
            print(f"{name:>12} {what:>12} per instruction: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
        print(f"{name:>12} per step: " + "  ".join(f"{what} {row['all']:.0f} (dispatch {row['dispatch']:.0f}, "
                                                 f"background {row['background']:.0f})"
                                                 for what, row in c["per_step"].items()))
    print("ours / torch framework CPU per instruction: " +
          ", ".join(f"{s} {v:.2f}x" for s, v in result["ours_vs_torch_framework_cpu"].items()))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(result: dict):
    plt = pyplot()
    med = result["median"]
    systems = list(med)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 1.4]})
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        per = med[s]["us_per_instruction"]
        xs = [j + i * width for j in range(len(KINDS))]
        ax.bar(xs, [per.get(k, 0.0) for k in KINDS], width, label=s,
               color=("#1f77b4" if s.startswith("ours") else "#7f7f7f"), alpha=1.0 - 0.35 * (i // 2))
    base = result["baseline_us_per_micro_batch"]
    for j, k in enumerate(("forward", "backward")):
        mean = statistics.mean(b[f"{k}_s"] for b in base)
        ax.plot([j - 0.1, j + 0.9], [mean, mean], "k--", lw=1, label="plain PyTorch compute" if j == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(KINDS))], KINDS)
    ax.set_ylabel("CPU us per instruction (step thread)")
    ax.legend(fontsize=7)
    bx.bar(range(len(systems)), [med[s]["framework_cpu_us_per_instruction"] for s in systems],
           color=["#1f77b4" if s.startswith("ours") else "#7f7f7f" for s in systems])
    bx.set_xticks(range(len(systems)), systems, fontsize=7, rotation=20)
    bx.set_ylabel("framework CPU us / instruction\n(all threads, minus compute)")
    load = result["machine"]["load_average_1_5_15"][0]
    fig.suptitle(f"{result['model']}, {len(result['stages'])} stages, {result['micro_batches']} x "
                 f"{result['batch_size']}, gloo loopback, load {load}", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
