"""bf16 vs fp32 through hybridpipe.Trainer: step time, bytes on the wire between stages, peak memory per rank.

    sudo .venv/bin/python benchmarks/precision.py                   # 4 emulated hosts at 1 Gbit/s (root)
    sudo .venv/bin/python benchmarks/precision.py --quick --rate 100mbit
    python benchmarks/precision.py --network loopback               # 4 local processes, no root
    python benchmarks/precision.py --network loopback --model demo  # make demo's GPT

The model is profiled here and split into 4 compute-balanced unreplicated stages (``partition
--strategy time``), one stage per emulated host (``tools/emucluster``: a network namespace per
process, ``tc tbf`` links of ``--rate``), ``--micro-batches`` x ``--batch-size`` per step,
synthetic data, Adam, gloo, one thread per process. Each precision runs ``--steps`` steps per
round through ``hybridpipe.Trainer(precision=...)``; the two alternate for ``--rounds`` rounds so
drifting load hits both. Step time of a job = its slowest rank's; a run reports the median over
the steps after ``--warmup``. Bytes: every rank's p2p channels count what they move (both
directions, per step): activations and gradients cross in the dtype the stage computed them in
(bf16: what autocast made 16-bit; a float32 residual stream stays float32). Peak memory per rank:
the most the rank's stage held in a step (``Trainer.last_peak_memory_bytes``: CUDA's max allocated,
or on the CPU the meter's count of weights, gradients, optimizer state and what autograd saved).
Results: ``benchmarks/results/precision[_emulated][_<model>][_quick].json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO,
    RESULT_TAG,
    emit_result,
    machine,
    pyplot,
    require_emulation,
    result_paths,
    setup_logging,
    worker_env,
    write_results,
)
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.plan import load_plan, save_plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.pipeline import MicroBatches  # noqa: E402
from hybridpipe.profiles.data import resolve_dataset  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402
from hybridpipe.runtime.trainer import Trainer  # noqa: E402

log = logging.getLogger("benchmarks.precision")
PRECISIONS = ("fp32", "bf16")
MODELS = {"demo": "gpt[layers=4,width=128,heads=4,seq=64,vocab=256]"}     # examples/demo.sh's model


class Bytes:
    """The timeline-recorder hooks the Trainer calls, counting p2p bytes (thread-safe)."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def on_transfer(self, peer: int, key: str, nbytes: int, t0: float, t1: float) -> None:
        with self._lock:
            self.n += nbytes

    def align(self, barrier) -> None:
        barrier()

    def record(self, phase: str, micro_batch: int, t0: float, t1: float, stage: int | None = None) -> None:
        pass


def job(rank: int, world: int, plan_path: str, precision: str, steps: int) -> dict | None:
    """One rank: ``steps`` steps in ``precision``; rank 0 returns the job's step times and bytes."""
    plan = load_plan(plan_path)
    counter = Bytes()
    trainer = Trainer(plan.model, plan, optimizer="adam", lr=1e-3, precision=precision, recorder=counter,
                      timeout=300)
    spec = resolve_model(plan.model)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=steps * plan.batch_size * plan.micro_batches),
                        plan.batch_size, plan.micro_batches)
    times, losses, peak = [], [], 0
    for k in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.train_step(*data.global_batch(k)))
        times.append((time.perf_counter() - t0) * 1e3)
        peak = max(peak, trainer.last_peak_memory_bytes)
    trainer.close()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (times, counter.n, peak))
    if rank != 0:
        return None
    return {"step_ms": [max(t[k] for t, _, _ in everyone) for k in range(steps)],
            "bytes_per_step": sum(n for _, n, _ in everyone) / steps, "losses": losses,
            "peak_memory_bytes": [p for _, _, p in everyone]}


def worker(a: argparse.Namespace) -> None:
    """One emulated host's process (``--worker``)."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        value = job(dist.get_rank(), dist.get_world_size(), a.plan, a.precision, a.steps)
    finally:
        dist.destroy_process_group()
    if value is not None:
        emit_result(value)
    sys.stdout.flush()
    os._exit(0)


def run(cluster, plan_path: Path, precision: str, steps: int, world: int) -> dict:
    if cluster is None:
        outcomes = run_local(job, world, str(plan_path), precision, steps, timeout_s=900, pg_timeout_s=300)
        problems = describe_failures(outcomes)
        if problems:
            raise RuntimeError(problems)
        return next(o.value for o in outcomes if o.value is not None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--plan", str(plan_path),
           "--precision", precision, "--steps", str(steps)]
    results = cluster.run(cmd, timeout_s=900, env=lambda host: worker_env(cluster, host, 1), cwd=REPO)
    for r in results:
        lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT_TAG)]
        if lines:
            return json.loads(lines[-1][len(RESULT_TAG):])
    raise RuntimeError(f"no host printed a result; host 0's output:\n{results[0].stdout[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt[layers=8,width=256,heads=4,seq=128,vocab=2048]",
                   help="a model spec, or 'demo' (make demo's gpt[layers=4,width=128,heads=4,seq=64,vocab=256])")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--network", choices=("loopback", "emulated"), default="emulated")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--quick", action="store_true", help="6 steps, 2 rounds")
    p.add_argument("--out-dir")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    setup_logging()
    if a.quick:
        a.steps, a.rounds, a.warmup = 6, 2, 2
    load_at_start = [round(x, 2) for x in os.getloadavg()]         # machine() below records it at the end
    label = a.model if a.model in MODELS else ""
    a.model = MODELS.get(a.model, a.model)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="precision."))
    plan_path = tmp / "plan.json"
    profile = profile_model(resolve_model(a.model), batch_size=a.batch_size, repeats=3, progress=False)
    cluster_desc = Cluster((Level("local", a.stages, 8.0, 500.0),), 16.0)
    save_plan(partition(profile, cluster_desc, Request(workers=a.stages, strategy="time",
                                                       micro_batches=a.micro_batches)).plan, plan_path)
    runs: dict[str, list[dict]] = {q: [] for q in PRECISIONS}
    with contextlib.ExitStack() as stack:
        cluster = None
        if a.network == "emulated":
            require_emulation()
            from tools.emucluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(a.stages, rate=a.rate))
        for r in range(a.rounds):
            for q in PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]:
                out = run(cluster, plan_path, q, a.steps, a.stages)
                out["median_ms"] = statistics.median(out["step_ms"][a.warmup:])
                runs[q].append(out)
                log.info("round %d %s: %.1f ms/step, %.2f MB/step on the wire", r, q, out["median_ms"],
                         out["bytes_per_step"] / 1e6)
    medians = {q: statistics.median(x["median_ms"] for x in runs[q]) for q in PRECISIONS}
    wire = {q: runs[q][0]["bytes_per_step"] for q in PRECISIONS}
    memory = {q: [max(x["peak_memory_bytes"][r] for x in runs[q]) for r in range(a.stages)] for q in PRECISIONS}
    result = {"benchmark": "precision", "machine": machine(), "command": " ".join(sys.argv), "model": a.model,
              "stages": a.stages, "micro_batches": a.micro_batches, "batch_size": a.batch_size, "steps": a.steps,
              "warmup": a.warmup, "rounds": a.rounds,
              "network": "loopback" if cluster is None else f"emulated {a.stages} hosts at {a.rate}",
              "median_step_ms": medians, "step_ms_per_round": {q: [x["median_ms"] for x in runs[q]] for q in runs},
              "p2p_bytes_per_step": wire, "bf16_vs_fp32_step": medians["bf16"] / medians["fp32"],
              "bf16_vs_fp32_bytes": wire["bf16"] / wire["fp32"],
              "peak_memory_bytes_per_rank": memory,
              "bf16_vs_fp32_peak_memory_per_rank": [b / f for b, f in zip(memory["bf16"], memory["fp32"], strict=True)],
              "load_average_at_start": load_at_start,
              "first_losses": {q: runs[q][0]["losses"] for q in PRECISIONS}}
    name = "precision" + ("_emulated" if a.network == "emulated" else "") + (f"_{label}" if label else "")
    json_path, png_path = result_paths(name, a.quick, a.out_dir)
    write_results(json_path, result, _figure(result), png_path)
    for q in PRECISIONS:
        print(f"{q}: {medians[q]:8.1f} ms/step  {wire[q] / 1e6:8.2f} MB/step between stages  peak per rank "
              + " ".join(f"{m / 2**20:.1f}" for m in memory[q]) + " MiB")
    print(f"bf16/fp32: step {result['bf16_vs_fp32_step']:.2f}x, bytes {result['bf16_vs_fp32_bytes']:.2f}x; "
          f"wrote {json_path} and {png_path}")
    return 0


def _figure(result: dict):
    plt = pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 3.4))
    qs = list(result["median_step_ms"])
    a1.bar(qs, [result["median_step_ms"][q] for q in qs], color=["#7f7f7f", "#1f77b4"])
    for i, q in enumerate(qs):
        a1.plot([i] * len(result["step_ms_per_round"][q]), result["step_ms_per_round"][q], "k.")
    a1.set_ylabel("ms per step (median of rounds)")
    a2.bar(qs, [result["p2p_bytes_per_step"][q] / 1e6 for q in qs], color=["#7f7f7f", "#1f77b4"])
    a2.set_ylabel("MB per step between stages")
    ranks = range(len(result["peak_memory_bytes_per_rank"][qs[0]]))
    for i, (q, color) in enumerate(zip(qs, ["#7f7f7f", "#1f77b4"], strict=False)):
        a3.bar([r + (i - 0.5) * 0.4 for r in ranks], [m / 2**20 for m in result["peak_memory_bytes_per_rank"][q]],
               width=0.4, color=color, label=q)
    a3.set_xticks(list(ranks))
    a3.set_xlabel("rank (stage)")
    a3.set_ylabel("peak memory (MiB)")
    a3.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, {result['stages']} stages, {result['micro_batches']} x "
                 f"{result['batch_size']}, {result['network']}", fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
