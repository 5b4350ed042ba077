"""How much slower one forward+loss+backward gets when N copies compute at once.

Emulated hosts share the machine's cores, so a worker computes slower than its profile says.
``measure_compute`` measures it: N processes (one thread each) build the model, wait until all
are ready, and each times its own iterations for a few seconds; the median per copy is the
contended time. The copies run on this machine (sharing its cores freely) or, given an
emulated cluster, one per host (inside the hosts' CPU quotas, if it has them: then N copies
should take as long as one). Used by ``plans.py`` to calibrate profiles for N emulated hosts.

    .venv/bin/python benchmarks/contention.py --model-spec 'alexnet[image=64]' --batch 32 --copies 4
    sudo .venv/bin/python benchmarks/contention.py --model-spec 'alexnet[image=64]' --batch 32 --copies 4 --cpus 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, emit_result, read_result, worker_env


def compute_worker(spec_name: str, batch: int, seconds: float, sync_dir: str, copies: int) -> None:
    """Build the model, wait until ``copies`` workers are ready, time forward+loss+backward for ``seconds``."""
    import torch

    from hybridpipe.profiles.calling import call_args, own_loss, training_switches
    from hybridpipe.profiles.zoo import resolve_model
    torch.set_num_threads(1)
    spec = resolve_model(spec_name)
    torch.manual_seed(0)
    model = spec.build()
    gen = torch.Generator().manual_seed(os.getpid())
    x, y = spec.example_input(batch, gen), spec.example_target(batch, gen)
    args, kwargs = call_args(x)                       # a dict batch (Hugging Face) as keywords
    kwargs.update(training_switches(model))

    def loss() -> torch.Tensor:                       # the model's own loss where it has no loss function
        out = model(*args, **kwargs)
        value = spec.loss(out, y) if spec.loss is not None else own_loss(out)
        assert value is not None, f"{spec_name} returned no loss and has no loss function"
        return value

    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)      # the runtime's default optimizer
    steps: list[float] = []

    def once() -> float:
        t = time.perf_counter()
        loss().backward()
        took = time.perf_counter() - t
        t = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=False)
        return took

    once()                                                     # warm-up (allocator, grads)
    sync = Path(sync_dir)
    (sync / f"ready-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + 600
    while len(list(sync.glob("ready-*"))) < copies:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(list(sync.glob('ready-*')))} of {copies} copies got ready in 600 s")
        time.sleep(0.01)
    times, end = [], time.perf_counter() + seconds
    steps.clear()
    while time.perf_counter() < end or len(times) < 2:
        times.append(once())
    emit_result({"median_ms": statistics.median(times) * 1e3, "iterations": len(times),
                 "sgd_step_ms": statistics.median(steps) * 1e3})


def measure_compute(spec: str, batch: int, copies: int, seconds: float, timeout_s: float = 600,
                    cluster=None) -> dict:
    """Median ms of one forward+backward per copy while ``copies`` processes (1 thread each) run at once
    (and of the sgd step after it); with ``cluster`` (an EmulatedCluster), copy i runs on host i."""
    with tempfile.TemporaryDirectory(prefix="hp-contention-") as sync:
        os.chmod(sync, 0o777)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model-spec", spec, "--batch", str(batch),
               "--seconds", str(seconds), "--sync-dir", sync, "--copies", str(copies)]
        if cluster is not None:
            if copies > len(cluster.hosts):
                raise ValueError(f"{copies} copies need {copies} emulated hosts, the cluster has {len(cluster.hosts)}")
            results = cluster.run(cmd, hosts=cluster.hosts[:copies], timeout_s=timeout_s, cwd=REPO,
                                  env=lambda host: worker_env(cluster, host))
            outs = [r.stdout for r in results]
        else:
            outs = _run_local(cmd, copies, timeout_s)
    per_copy = [read_result(o)["median_ms"] for o in outs]
    return {"copies": copies, "median_ms": statistics.median(per_copy), "per_copy_ms": per_copy,
            "sgd_step_ms": statistics.median(read_result(o)["sgd_step_ms"] for o in outs),
            "iterations": [read_result(o)["iterations"] for o in outs]}


def _run_local(cmd: list[str], copies: int, timeout_s: float) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(copies)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = next(((o, e) for (o, e), p in zip(outs, procs, strict=True) if p.returncode), None)
    if bad:
        raise RuntimeError("a compute copy failed: " + bad[1][-2000:])
    return [o for o, _ in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-spec", required=True, help="a zoo model spec, e.g. 'alexnet[image=64]'")
    p.add_argument("--batch", type=int, required=True, help="samples per forward+backward")
    p.add_argument("--copies", type=int, default=1, help="processes computing at once (default 1)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds each copy times (default 5)")
    p.add_argument("--cpus", type=float, default=None, help="run copy i on emulated host i of a cluster whose "
                   "hosts each get this many cores (needs root; default: local processes, cores shared freely)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        compute_worker(args.model_spec, args.batch, args.seconds, args.sync_dir, args.copies)
        return 0
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.cpus is not None:
            from tools.emucluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(args.copies, rate=None, cpus=args.cpus))
        alone = measure_compute(args.model_spec, args.batch, 1, args.seconds, cluster=cluster)
        shared = measure_compute(args.model_spec, args.batch, args.copies, args.seconds,
                                 cluster=cluster) if args.copies > 1 else alone
    where = f"one per emulated host of {args.cpus:g} cores" if cluster else "local processes"
    print(f"{args.model_spec} batch {args.batch} ({where}): alone {alone['median_ms']:.1f} ms, {args.copies} "
          f"copies {shared['median_ms']:.1f} ms per copy ({shared['median_ms'] / alone['median_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
