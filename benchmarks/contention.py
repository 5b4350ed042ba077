"""How much slower one forward+loss+backward gets when N copies share this machine's cores.

Emulated hosts share the machine's cores, so a worker computes slower than its profile says.
``measure_compute`` measures it: N processes (one thread each) build the model, wait for a
common start, and each times its own iterations for a few seconds; the median per copy is the
contended time. Used by ``plans.py`` to calibrate profiles for N emulated hosts.

    .venv/bin/python benchmarks/contention.py --model-spec 'alexnet[image=64]' --batch 32 --copies 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, emit_result, read_result


def compute_worker(spec_name: str, batch: int, seconds: float, sync_dir: str) -> None:
    """Build the model, wait for the go file, time forward+loss+backward for ``seconds``."""
    import torch

    from hybridpipe.profiles.zoo import resolve_model
    torch.set_num_threads(1)
    spec = resolve_model(spec_name)
    torch.manual_seed(0)
    model = spec.build()
    gen = torch.Generator().manual_seed(os.getpid())
    x, y = spec.example_input(batch, gen), spec.example_target(batch, gen)

    def once() -> float:
        t = time.perf_counter()
        spec.loss(model(x), y).backward()
        model.zero_grad(set_to_none=False)
        return time.perf_counter() - t

    once()                                                     # warm-up (allocator, grads)
    sync = Path(sync_dir)
    (sync / f"ready-{os.getpid()}").touch()
    while not (sync / "go").exists():
        time.sleep(0.01)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 2:
        times.append(once())
    emit_result({"median_ms": statistics.median(times) * 1e3, "iterations": len(times)})


def measure_compute(spec: str, batch: int, copies: int, seconds: float, timeout_s: float = 600) -> dict:
    """Median ms of one forward+backward per copy while ``copies`` processes (1 thread each) run at once."""
    with tempfile.TemporaryDirectory(prefix="hp-contention-") as sync:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model-spec", spec,
               "--batch", str(batch), "--seconds", str(seconds), "--sync-dir", sync]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(copies)]
        try:
            deadline = time.monotonic() + timeout_s
            while len(list(Path(sync).glob("ready-*"))) < copies:
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError("a compute copy failed to start: " + _first_error(procs))
                time.sleep(0.05)
            (Path(sync) / "go").touch()
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("a compute copy failed: " + next(e for (o, e), p in zip(outs, procs) if p.returncode)[-2000:])
    per_copy = [read_result(o)["median_ms"] for o, _ in outs]
    return {"copies": copies, "median_ms": statistics.median(per_copy), "per_copy_ms": per_copy,
            "iterations": [read_result(o)["iterations"] for o, _ in outs]}


def _first_error(procs) -> str:
    for p in procs:
        if p.poll() not in (None, 0):
            return p.stderr.read()[-2000:]
    return "timed out"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-spec", required=True, help="a zoo model spec, e.g. 'alexnet[image=64]'")
    p.add_argument("--batch", type=int, required=True, help="samples per forward+backward")
    p.add_argument("--copies", type=int, default=1, help="processes computing at once (default 1)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds each copy times (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        compute_worker(args.model_spec, args.batch, args.seconds, args.sync_dir)
        return 0
    alone = measure_compute(args.model_spec, args.batch, 1, args.seconds)
    shared = measure_compute(args.model_spec, args.batch, args.copies, args.seconds) if args.copies > 1 else alone
    print(f"{args.model_spec} batch {args.batch}: alone {alone['median_ms']:.1f} ms, {args.copies} copies "
          f"{shared['median_ms']:.1f} ms per copy ({shared['median_ms'] / alone['median_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
