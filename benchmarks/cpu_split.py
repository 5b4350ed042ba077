"""Where each side's CPU goes, per step and rank: hybridpipe's 1F1B vs torch.distributed.pipelining's,
split by thread, by user / system time, with page faults, context switches and aten ops.

    python benchmarks/cpu_split.py          # GPT-2 12 x 256, vocabulary 8192, 4 stages, 8 x 4, ours and torch's 1F1B
    python benchmarks/cpu_split.py --systems ours,ours-system,torch --rounds 2 --tag alloc

On ``--stages`` local processes over gloo (one thread each, as ``vs_torch_pipelining.py`` runs
them) both systems run the same compute-balanced stages: ours through the Trainer (channels
``sa``, the engine), torch's ``build_theirs`` (benchmarks/torch_side.py). Each rank reads,
between the start of step ``--warmup`` and the start of the last step: its process's
``getrusage`` (user and system CPU, minor faults, voluntary and involuntary context switches)
and every thread's ``/proc/self/task/TID/stat`` (user, system ticks, minor faults) and
``schedstat`` (CPU ns), grouped by thread label (overhead_threads.py); then, during the last
step, the aten ops the step's thread dispatches (a ``TorchDispatchMode``; backward included:
on the CPU autograd runs on the calling thread). Counts (faults, switches, ops) do not depend on
the load; CPU times do. ``--systems`` runs alternate ``--rounds`` times. Results:
``benchmarks/results/cpu_split[_TAG].json``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import overhead_threads  # noqa: E402
from benchmarks.common import machine, result_paths, write_results  # noqa: E402
from benchmarks.vs_torch_pipelining import make_plan  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


class OpCount(TorchDispatchMode):
    """aten ops by name, on the thread that entered the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _usage() -> dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "sys_s": r.ru_stime, "minflt": r.ru_minflt, "majflt": r.ru_majflt,
            "vcsw": r.ru_nvcsw, "ivcsw": r.ru_nivcsw}


def _task_stats() -> dict[int, tuple[float, float, int]]:
    """tid -> (user s, system s, minor faults) from /proc (clock ticks: 10 ms resolution)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(rest[11]) / TICK, int(rest[12]) / TICK, int(rest[7]))
    return out


def _loops_apart(snap: dict[int, tuple]) -> dict[int, tuple]:
    """``snap`` with each gloo event-loop thread labelled by its creation order (``gloo loop#0``: the
    default group's device, made first; a later one is a device of its own, e.g. a plain gloo group's)."""
    loops = sorted(tid for tid, row in snap.items() if row[-1] == "gloo loop")
    return {**snap, **{tid: (*snap[tid][:-1], f"gloo loop#{i}") for i, tid in enumerate(loops)}}


def measured(step, steps: int, warmup: int) -> dict:
    """Run ``step(k)`` for k < steps; the process's and every thread's use between the start of
    step ``warmup`` and the start of the last step, per step; the last step's aten ops."""
    marks: dict = {}
    walls = []
    counter = OpCount()
    for k in range(steps):
        if k in (warmup, steps - 1):
            marks[k] = (_usage(), _task_stats(), _loops_apart(overhead_threads.snapshot()), time.perf_counter())
        if k == steps - 1:
            with counter:
                step(k)
        else:
            t0 = time.perf_counter()
            step(k)
            if k >= warmup:
                walls.append((time.perf_counter() - t0) * 1e3)
    n = steps - 1 - warmup
    (u0, t0s, s0, w0), (u1, t1s, s1, w1) = marks[warmup], marks[steps - 1]
    usage = {k: (u1[k] - u0[k]) / n for k in u0}
    labels = overhead_threads.delta(s0, s1, n)
    names = {tid: lab for tid, (*_, lab) in s1.items()}
    for tid, (us, ss, mf) in t1s.items():
        b = t0s.get(tid, (0.0, 0.0, 0))
        row = labels.setdefault(names.get(tid, "?"), {})
        row["user_s"] = row.get("user_s", 0.0) + (us - b[0]) / n
        row["sys_s"] = row.get("sys_s", 0.0) + (ss - b[1]) / n
        row["minflt"] = row.get("minflt", 0.0) + (mf - b[2]) / n
    return {"usage_per_step": usage, "threads_per_step": labels, "wall_ms": walls,
            "wall_between_marks_ms": (w1 - w0) / n * 1e3, "ops_last_step": dict(counter.ops)}


def ours_rank(rank: int, world: int, plan_path: str, steps: int, warmup: int, allocator: str = "keep") -> dict:
    from benchmarks.torch_side import LR, MOMENTUM, SEED
    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.pipeline import MicroBatches
    from hybridpipe.profiles.data import resolve_dataset
    from hybridpipe.profiles.zoo import resolve_model
    from hybridpipe.runtime.trainer import Trainer

    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=steps * plan.micro_batches * plan.batch_size,
                                        seed=SEED), plan.batch_size, plan.micro_batches, targets=spec.loss is not None)
    trainer = Trainer(plan.model, plan_path, lr=LR, momentum=MOMENTUM, seed=SEED, data=data, comm_mode="sa",
                      timeout=120, cpu_allocator=allocator)
    try:
        return measured(lambda k: trainer.train_step(), steps, warmup)
    finally:
        trainer.close()


def theirs_rank(rank: int, world: int, plan_path: str, steps: int, warmup: int) -> dict:
    from benchmarks.torch_side import build_theirs

    run = build_theirs(rank, plan_path, steps, "Schedule1F1B")
    return measured(lambda k: run.step(run.batch(k)), steps, warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf:gpt2[n_layer=12,n_embd=256,n_head=4,vocab_size=8192,seq=128,dropout=0]")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--systems", default="ours,torch", help="comma-separated: ours (freed memory kept, the "
                   "default), ours-system (--cpu-allocator system), torch")
    p.add_argument("--out-dir")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="cpu_split."))
    make_plan(a.model, a.stages, a.micro_batches, a.batch_size, tmp / "plan.json")
    fns = {"ours": (ours_rank, ()), "ours-system": (ours_rank, ("system",)), "torch": (theirs_rank, ())}
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    runs: dict[str, list] = {s: [] for s in systems}
    for r in range(a.rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            fn, extra = fns[s]
            outcomes = run_local(fn, a.stages, str(tmp / "plan.json"), a.steps, a.warmup, *extra, timeout_s=900,
                                 pg_timeout_s=300)
            if problems := describe_failures(outcomes):
                raise RuntimeError(problems)
            runs[s].append([o.value for o in sorted(outcomes, key=lambda o: o.rank)])
            ranks = runs[s][-1]
            print(f"round {r} {s}: wall/step {max(x['wall_between_marks_ms'] for x in ranks):.0f} ms, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            for i, x in enumerate(ranks):
                u = x["usage_per_step"]
                print(f"  rank {i}: user {u['user_s'] * 1e3:7.1f} sys {u['sys_s'] * 1e3:6.1f} ms  minflt "
                      f"{u['minflt']:8.0f}  vcsw {u['vcsw']:5.0f} ivcsw {u['ivcsw']:5.0f}  ops "
                      f"{sum(x['ops_last_step'].values())}", flush=True)
                for label, row in sorted(x["threads_per_step"].items(), key=lambda kv: -kv[1].get("cpu_us", 0)):
                    if row.get("cpu_us", 0) > 100 or row.get("minflt", 0) > 10:
                        print(f"      {label:>16}: cpu {row.get('cpu_us', 0) / 1e3:7.1f} ms (user "
                              f"{row.get('user_s', 0) * 1e3:.0f} sys {row.get('sys_s', 0) * 1e3:.0f}) minflt "
                              f"{row.get('minflt', 0):7.0f} wake {row.get('wakeups', 0):5.0f} "
                              f"preempt {row.get('preempted', 0):5.0f}", flush=True)
    for ours in (s for s in runs if s.startswith("ours") and "torch" in runs):
        for i in range(a.stages):
            o, t = runs[ours][0][i]["ops_last_step"], runs["torch"][0][i]["ops_last_step"]
            diff = {k: o.get(k, 0) - t.get(k, 0) for k in set(o) | set(t) if o.get(k, 0) != t.get(k, 0)}
            print(f"rank {i} aten ops {ours} - torch (last step): "
                  f"{dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))}")
    result = {"benchmark": "cpu_split", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
              "stages": a.stages, "micro_batches": a.micro_batches, "batch_size": a.batch_size, "steps": a.steps,
              "warmup": a.warmup, "runs": runs,
              "median_user_ms": {s: statistics.median(sum(x["usage_per_step"]["user_s"] for x in ranks) * 1e3
                                                      for ranks in v) for s, v in runs.items()}}
    json_path, _ = result_paths("cpu_split" + (f"_{a.tag}" if a.tag else ""), False, a.out_dir)
    write_results(json_path, result)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
