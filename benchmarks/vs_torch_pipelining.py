"""hybridpipe's schedules vs ``torch.distributed.pipelining``'s: same model, split, micro-batches.

    python benchmarks/vs_torch_pipelining.py                       # alexnet-small, 4 stages, 8 x 16
    python benchmarks/vs_torch_pipelining.py --quick               # fewer steps and rounds
    python benchmarks/vs_torch_pipelining.py --model mlp[hidden=1024] --stages 2 --modes sa,sra
    python benchmarks/vs_torch_pipelining.py --schedules gpipe,1f1b,zb-h1 \
        --torch-schedules ScheduleGPipe,Schedule1F1B,ScheduleInterleaved1F1B,ScheduleInterleavedZeroBubble
    python benchmarks/vs_torch_pipelining.py --stages 2 --virtual-stages 2 --schedules interleaved-1f1b,zbv \
        --torch-schedules ScheduleInterleaved1F1B,ScheduleZBVZeroBubble

The model is profiled in this process (one thread, as the workers run) and split into
``--stages`` stages with balanced compute (``hybridpipe partition --strategy time``); both
systems run exactly those stages (hybridpipe's cut of the captured graph, the same GraphModules
handed to torch's ``PipelineStage``), ``--micro-batches`` micro-batches of ``--batch-size`` samples per step, SGD
after each step, synthetic data fetched inside the timed step on both sides, gloo on loopback,
one process per stage and one thread per process.

hybridpipe runs through its worker (``run_worker``: channels, engine, metrics) with each p2p
mode of ``--modes`` and each schedule of ``--schedules`` (system ``hybridpipe-MODE`` for 1f1b,
``hybridpipe-SCHEDULE-MODE`` otherwise); torch runs each class of ``--torch-schedules``
(``SCHEDULE.step`` + ``optimizer.step``). With ``--virtual-stages V`` the model is split into
``--stages`` x V chunks instead, balanced by compute, and the schedules that hold several chunks
per rank -- ours ``interleaved-1f1b`` and ``zbv``, torch's multi-stage classes -- run exactly those
chunks, each placed as the schedule places them (looped: chunk s on rank s mod p for
interleaved-1f1b, Interleaved1F1B, InterleavedZeroBubble, LoopedBFS; the V: rank r holds chunks r
and 2p-1-r for zbv, ZBVZeroBubble, DualPipeV); the one-stage-per-rank schedules run a split into
``--stages`` stages. Without it the multi-stage classes get this rank's one stage (ZBV and
DualPipeV need two and cannot run). Step time of a job =
its slowest rank's step; each run reports the median over the steps after ``--warmup``. The
systems alternate, ``--rounds`` times, so drifting load on a shared machine hits both; the
ratio is torch's median step over ours (> 1: hybridpipe is faster). Results:
``benchmarks/results/vs_torch_pipelining[_emulated][_TAG][_quick].json`` and ``.png``; the
machine's load average is recorded with them (on 2 cores, other work changes the picture).

``--network emulated --rate 1gbit`` (root) runs both systems on ``--stages`` emulated hosts
(``tools/emucluster``: a network namespace per process, ``tc tbf`` links of that rate to a
switch) instead of local processes on loopback, one process per host, so every activation and
gradient costs real transfer time and overlapping it with compute counts:

    sudo .venv/bin/python benchmarks/vs_torch_pipelining.py --network emulated --rate 1gbit --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import statistics
import sys
import tempfile
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
from benchmarks.torch_side import LR, MOMENTUM, SEED, TORCH_LOOPED, TORCH_V, theirs  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402
from hybridpipe.partitioner.cost.cluster import Cluster, Level  # noqa: E402
from hybridpipe.partitioner.plan import Plan, load_plan, save_plan  # noqa: E402
from hybridpipe.partitioner.planner import Request, partition  # noqa: E402
from hybridpipe.partitioner.schedule_registry import get_schedule  # noqa: E402
from hybridpipe.profiles.profiler import profile_model  # noqa: E402
from hybridpipe.profiles.zoo import resolve_model  # noqa: E402
from hybridpipe.runtime.config import build_parser, resolve  # noqa: E402
from hybridpipe.runtime.worker import run_worker  # noqa: E402
from tools.emucluster.topology import parse_rate  # noqa: E402

log = logging.getLogger("benchmarks.vs_torch_pipelining")


def chunk_layout(system: str) -> str | None:
    """``looped`` or ``v`` for a system that holds several model chunks per rank, else None."""
    kind = system.split("-", 1)[1] if system.startswith("torch-") else system_schedule(system)[0]
    if kind in TORCH_LOOPED:
        return "looped"
    if kind in TORCH_V:
        return "v"
    if system.startswith("torch-") or system == "hybridpipe-best":
        return None
    layout = get_schedule(kind).layout
    return None if layout == "single" else layout


def placed(chunks: Plan, ranks: int, layout: str) -> Plan:
    """``chunks`` (p*V unreplicated stages, one per rank) placed on ``ranks`` rank groups as
    ``layout`` says (the stages, their nodes and tied groups unchanged)."""
    kind = get_schedule("zbv" if layout == "v" else "interleaved-1f1b")
    stages = tuple(dataclasses.replace(s, ranks=(kind.group_of(s.index, ranks),)) for s in chunks.stages)
    return dataclasses.replace(chunks, stages=stages, virtual_stages=len(stages) // ranks,
                               schedule="zbv" if layout == "v" else "interleaved-1f1b")


def make_plan(model: str, stages: int, micro_batches: int, batch_size: int, path: Path,
              best_path: Path | None = None, rate_gbps: float = 1.0, virtual: int = 1) -> None:
    """Profile ``model`` here and split it into ``stages`` compute-balanced, unreplicated stages;
    with ``virtual`` V > 1 also into ``stages`` x V chunks, placed looped (``path`` + ``.looped``)
    and as a V (``.v``); with ``best_path``, also hybridpipe's own choice (strategy optimal) for
    ``stages`` hosts linked at ``rate_gbps``."""
    torch.set_num_threads(1)
    profile = profile_model(resolve_model(model), batch_size=batch_size, repeats=3, progress=False)
    cluster = Cluster((Level("local", stages, 8.0, 500.0),), 4.0)
    plan = partition(profile, cluster, Request(workers=stages, strategy="time", micro_batches=micro_batches)).plan
    save_plan(plan, path)
    if virtual > 1:
        many = Cluster((Level("local", stages * virtual, 8.0, 500.0),), 4.0)
        chunks = partition(profile, many, Request(workers=stages * virtual, strategy="time",
                                                  micro_batches=micro_batches)).plan
        if len(chunks.stages) != stages * virtual:
            raise SystemExit(f"the model splits into {len(chunks.stages)} balanced chunks, not {stages * virtual}")
        for layout in ("looped", "v"):
            save_plan(placed(chunks, stages, layout), layout_path(path, layout))
    if best_path is not None:
        hosts = Cluster((Level("node", 1, 1000.0), Level("network", stages, rate_gbps, 50.0)), 16.0)
        save_plan(partition(profile, hosts, Request(workers=stages, micro_batches=micro_batches)).plan, best_path)


def layout_path(path: Path, layout: str | None) -> Path:
    """The plan file of a chunk layout (None: the one-stage-per-rank plan ``path``)."""
    return path if layout is None else path.with_suffix(f".{layout}.json")


def ours(rank: int, world: int, plan_path: str, steps: int, mode: str, run_dir: str,
         schedule: str = "1f1b") -> dict | None:
    """hybridpipe's worker on this rank; the reporting rank returns the job's step times."""
    args = build_parser().parse_args(["--plan", plan_path, "--steps", str(steps), "--lr", str(LR),
                                      "--momentum", str(MOMENTUM), "--seed", str(SEED), "--comm-mode", mode,
                                      "--schedule", schedule,
                                      "--run-dir", run_dir, "--no-trace", "--no-progress", "--timeout", "120"])
    summary = run_worker(resolve(args, world), print_fn=lambda _: None)
    return None if summary is None else {int(k): v for k, v in summary["job_step_ms"].items()}


def worker(a: argparse.Namespace) -> None:
    """One emulated host's process (``--worker``): join the job (env://), run one system, and
    print the job's step times (the rank holding them)."""
    import os

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if a.system.startswith("torch-"):
            value = theirs(rank, world, a.plan, a.steps, a.system.split("-", 1)[1])
        else:
            schedule, mode = system_schedule(a.system)
            value = ours(rank, world, a.plan, a.steps, mode, a.run_dir, schedule)
    finally:
        dist.destroy_process_group()
    if value is not None:
        emit_result(value)
    sys.stdout.flush()
    os._exit(0)             # skip interpreter teardown (p2p threads are already closed)


def run_emulated(cluster, name: str, plan_path: Path, steps: int, run_dir: Path, timeout_s: float) -> dict[int, float]:
    """Run system ``name`` with one process per emulated host; the job's step times."""
    import json

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--system", name, "--plan", str(plan_path),
           "--steps", str(steps), "--run-dir", str(run_dir)]
    results = cluster.run(cmd, timeout_s=timeout_s, env=lambda host: worker_env(cluster, host, 1), cwd=REPO)
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT_TAG)]
        if lines:
            return {int(k): float(v) for k, v in json.loads(lines[-1][len(RESULT_TAG):]).items()}
    raise RuntimeError(f"no host printed the step times of {name}; host 0's output:\n{results[0].stdout[-2000:]}")


def system_schedule(name: str) -> tuple[str, str]:
    """(schedule, p2p mode) of a hybridpipe system name: ``hybridpipe-sa`` (1f1b),
    ``hybridpipe-zb-h1-sa``, ``hybridpipe-best`` (its own plan, made for 1f1b; mode sa)."""
    rest = name.removeprefix("hybridpipe-")
    if rest == "best":
        return "1f1b", "sa"
    schedule, _, mode = rest.rpartition("-")
    return schedule or "1f1b", mode


def job_median(step_ms: dict[int, float], warmup: int) -> float:
    return statistics.median(v for k, v in sorted(step_ms.items()) if k >= warmup)


def run_job(fn, world: int, *args) -> dict[int, float]:
    outcomes = run_local(fn, world, *args, timeout_s=900, pg_timeout_s=300)
    problems = describe_failures(outcomes)
    if problems:
        raise RuntimeError(problems)
    return next(o.value for o in outcomes if o.value is not None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="alexnet-small")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages = processes (2-4 on this machine)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per process for the schedules that hold several (interleaved-1f1b, zbv, "
                        "torch's multi-stage classes); default 1")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of every system")
    p.add_argument("--modes", default="sa", help="hybridpipe p2p modes to run (comma-separated)")
    p.add_argument("--schedules", default="1f1b", help="hybridpipe schedules to run (comma-separated)")
    p.add_argument("--torch-schedules", default="Schedule1F1B",
                   help="torch.distributed.pipelining schedule classes to run (comma-separated)")
    p.add_argument("--quick", action="store_true", help="10 steps, 2 rounds")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the result files' names (e.g. loaded)")
    p.add_argument("--network", choices=("loopback", "emulated"), default="loopback",
                   help="local processes on 127.0.0.1 (default), or one emulated host per stage (root)")
    p.add_argument("--rate", default="1gbit", help="emulated link rate (tc tbf; default 1gbit)")
    p.add_argument("--best", action="store_true",
                   help="also run hybridpipe's own plan for these hosts (partition --strategy optimal, replicas "
                        "allowed) as system hybridpipe-best")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    setup_logging(a.verbose)
    if a.quick:
        a.steps, a.warmup, a.rounds = 10, 3, 2
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="vs_torch_pp."))
    plan_path, best_path = tmp / "plan.json", tmp / "best.json"
    make_plan(a.model, a.stages, a.micro_batches, a.batch_size, plan_path, best_path if a.best else None,
              parse_rate(a.rate) / 1e9, a.virtual_stages)
    plan = load_plan(plan_path)
    log.info("stages (node ranges): %s", [(s.first_node, s.last_node) for s in plan.stages])
    ours_names = [f"hybridpipe-{m}" if s == "1f1b" else f"hybridpipe-{s}-{m}"
                  for s in a.schedules.split(",") for m in modes]
    torch_names = [f"torch-{t.strip()}" for t in a.torch_schedules.split(",") if t.strip()]
    systems = ours_names + torch_names + (["hybridpipe-best"] if a.best else [])
    runs: dict[str, list[float]] = {s: [] for s in systems}
    steps_ms: dict[str, list[dict]] = {s: [] for s in systems}
    with contextlib.ExitStack() as stack:
        cluster = None
        if a.network == "emulated":
            require_emulation()
            from tools.emucluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(a.stages, rate=a.rate))
        for r in range(a.rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            for name in order:
                run_dir = tmp / f"run-{name}-{r}"
                layout = chunk_layout(name) if a.virtual_stages > 1 else None
                path = best_path if name == "hybridpipe-best" else layout_path(plan_path, layout)
                if cluster is not None:
                    step_ms = run_emulated(cluster, name, path, a.steps, run_dir, 900)
                elif name.startswith("hybridpipe-"):
                    schedule, mode = system_schedule(name)
                    step_ms = run_job(ours, a.stages, str(path), a.steps, mode, str(run_dir), schedule)
                else:
                    step_ms = run_job(theirs, a.stages, str(path), a.steps, name.split("-", 1)[1])
                runs[name].append(job_median(step_ms, a.warmup))
                steps_ms[name].append(step_ms)
                log.info("round %d %s: %.1f ms/step", r, name, runs[name][-1])
    global_batch = a.micro_batches * a.batch_size
    medians = {s: statistics.median(v) for s, v in runs.items()}
    torch_ms = min(medians[t] for t in torch_names)          # torch's best schedule
    result = {
        "benchmark": "vs_torch_pipelining", "machine": machine(), "command": " ".join(sys.argv),
        "model": a.model, "stages": [[s.first_node, s.last_node] for s in plan.stages],
        "virtual_stages": a.virtual_stages,
        "chunks": ([[s.first_node, s.last_node, s.ranks[0]] for s in load_plan(layout_path(plan_path, "v")).stages]
                   if a.virtual_stages > 1 else None),
        "best_plan": ([[s.first_node, s.last_node, s.replicas] for s in load_plan(best_path).stages]
                      if a.best else None),
        "micro_batches": a.micro_batches, "batch_size": a.batch_size, "steps": a.steps, "warmup": a.warmup,
        "rounds": a.rounds, "backend": "gloo", "threads_per_process": 1,
        "network": a.network if a.network == "loopback" else f"emulated {a.stages} hosts at {a.rate}",
        "step_ms_per_round": runs, "median_step_ms": medians,
        "samples_per_s": {s: global_batch / m * 1e3 for s, m in medians.items()},
        "throughput_vs_torch": {s: torch_ms / m for s, m in medians.items() if s.startswith("hybridpipe")},
        "torch_best": min(torch_names, key=medians.__getitem__),
        "job_step_ms": steps_ms,
    }
    name = "vs_torch_pipelining" + ("_emulated" if a.network == "emulated" else "") + (f"_{a.tag}" if a.tag else "")
    json_path, png_path = result_paths(name, a.quick, a.out_dir)
    write_results(json_path, result, _figure(result), png_path)
    for s, m in medians.items():
        ratio = f"  ({torch_ms / m:.2f}x torch's best throughput)" if s.startswith("hybridpipe") else ""
        print(f"{s:>22}: {m:8.1f} ms/step  {global_batch / m * 1e3:8.1f} samples/s{ratio}")
    print(f"wrote {json_path} and {png_path}")
    return 0


def _figure(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = list(result["median_step_ms"])
    gb = result["micro_batches"] * result["batch_size"]
    for i, name in enumerate(names):
        per_round = [gb / ms * 1e3 for ms in result["step_ms_per_round"][name]]
        colour = "#1f77b4" if name.startswith("hybrid") else "#7f7f7f"
        ax.bar(i, gb / result["median_step_ms"][name] * 1e3, color=colour)
        ax.plot([i] * len(per_round), per_round, "k.", label="rounds" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("samples/s (median of rounds)")
    ratios = ", ".join(f"{k}: {v:.2f}x" for k, v in result["throughput_vs_torch"].items())
    ax.set_title(f"{result['model']}, {len(result['stages'])} stages, {result['micro_batches']} x "
                 f"{result['batch_size']}, gloo, {result.get('network', 'loopback')}; vs torch's best\n{ratios}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
