"""Shared helpers of the benchmark scripts: the machine description, result files, sizes,
timing statistics, and running a benchmark's worker on every host of an emulated cluster.

A benchmark script runs in two roles: the *driver* (builds emulated clusters, launches the
workers, writes JSON + PNG into ``benchmarks/results/``) and the *worker* (the same script with
``--worker``, one process per emulated host, ``init_process_group("env://")`` with
rank = host index). Rank 0 hands its result back as one ``RESULT {json}`` line on stdout.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridpipe.jsonfile import write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RESULT_TAG = "RESULT "

log = logging.getLogger("benchmarks")

# ---- statistics ----------------------------------------------------------------------------

def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the spread (max/min - 1) of repeated timings."""
    if not samples:
        raise ValueError("no samples")
    lo, hi = min(samples), max(samples)
    return {"median": statistics.median(samples), "min": lo, "max": hi, "n": len(samples),
            "spread": (hi / lo - 1.0) if lo > 0 else float("inf")}


# ---- the machine ---------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, kernel, torch, commit, date, load."""
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    mem_gb = None
    try:
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
        mem_gb = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    import torch
    return {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],   # others' work on the machine
            "host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_gb": mem_gb,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "commit": commit, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


# ---- result files --------------------------------------------------------------------------

def result_paths(name: str, quick: bool, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """``benchmarks/results/<name>[_quick].json`` and ``.png``."""
    folder = Path(out_dir) if out_dir else RESULTS
    stem = f"{name}_quick" if quick else name
    return folder / f"{stem}.json", folder / f"{stem}.png"


def write_results(json_path: Path, data: Mapping[str, Any], figure: Any | None = None,
                  png_path: Path | None = None) -> None:
    """Write the JSON (atomically) and, if given, the matplotlib figure as PNG."""
    write_json(json_path, dict(data))
    if figure is not None and png_path is not None:
        png_path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(png_path, dpi=110, bbox_inches="tight")
    log.info("wrote %s%s", json_path, f" and {png_path}" if figure is not None else "")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ---- driver <-> worker ---------------------------------------------------------------------

def emit_result(data: Any) -> None:
    """Worker side: hand ``data`` to the driver (rank 0 only calls this)."""
    print(RESULT_TAG + json.dumps(data), flush=True)


def read_result(stdout: str) -> Any:
    """Driver side: the last ``RESULT`` line of a worker's stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        raise RuntimeError("the worker printed no RESULT line; its output:\n" + stdout[-2000:])
    return json.loads(lines[-1][len(RESULT_TAG):])


def worker_env(cluster: Any, host: Any, threads: int = 1) -> dict[str, str]:
    """The environment of a benchmark process on ``host``: the cluster's, the repo importable, N threads."""
    return {**cluster.env(host), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}


def run_workers(cluster: Any, script: str | os.PathLike, worker_args: Sequence[str], *, timeout_s: float,
                threads_per_worker: int = 1, env: Mapping[str, str] | None = None) -> Any:
    """Run ``python script --worker ARGS`` on every host of ``cluster``; return rank 0's result."""
    results = cluster.run([sys.executable, str(script), "--worker", *worker_args], timeout_s=timeout_s,
                          env=lambda host: {**worker_env(cluster, host, threads_per_worker), **(env or {})},
                          cwd=REPO)
    return read_result(results[0].stdout)


def require_emulation() -> None:
    """Refuse with a clear message where the emulated cluster cannot be built."""
    from tools.emucluster import netns
    netns.check_prerequisites()


def setup_logging(verbose: bool = False) -> None:
    """Log to stderr with times; SIGTERM becomes KeyboardInterrupt, so emulated clusters tear down."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def bench_lock(path: str | None):
    """Hold the machine's benchmark lock (flock on ``path``) for one group; yields the seconds waited."""
    if not path:
        yield 0.0
        return
    t = time.monotonic()
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = round(time.monotonic() - t, 1)
        if waited > 1:
            log.info("waited %.0f s for the benchmark lock %s", waited, path)
        try:
            yield waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
