"""Per-step metrics: a JSON-lines file per rank and the progress bar.

``RUN_DIR/metrics/rank-00003.jsonl`` gets one line per step::

    {"step": 7, "step_ms": 412.5, "samples_per_s": 310.3, "loss": 2.291, "micro_batches": 2, "time": 1730000000.1}

``loss`` (the mean of this rank's micro-batch losses, weighted by their tokens under
``--loss-normalization tokens``) and ``micro_batches`` appear on ranks of
the last stage only; ``lr`` (the step's learning rate, ranks with parameters), ``grad_norm``
(``--clip-grad-norm``: the global norm before clipping), ``loss_scale`` (``--precision fp16``)
and ``eval_loss`` (``--eval-every``: the held-out mean loss) on every rank; with
``--eval-every`` a line ``{"step": S - 1, "eval_loss": ...}`` before the first step S (0 unless
resumed) holds the loss before training.
``samples_per_s`` is the job's global batch over this rank's step time;
``peak_memory_bytes`` is what the rank's stage held at its peak in the step (pipeline/memory.py).
The file is appended to and flushed every line, so a crashed or resumed run keeps its history.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm

METRICS_SUBDIR = "metrics"


def metrics_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / METRICS_SUBDIR / f"rank-{rank:05d}.jsonl"


class MetricsWriter:
    """Appends one JSON object per step to this rank's metrics file."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.path = metrics_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a")

    def write(self, record: dict) -> None:
        if self._file is None:
            raise RuntimeError(f"metrics file {self.path} is closed")
        self._file.write(json.dumps(dict(record, time=round(time.time(), 3))) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of one metrics file (a torn last line, from a crash, is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def step_record(step: int, seconds: float, global_batch: int, losses: list[float], peak_memory_bytes: int = 0,
                weights: list[float] | None = None) -> dict:
    """One metrics line (see the module docstring); ``weights``: the micro-batches' valid tokens
    (``--loss-normalization tokens``: the loss is their token-weighted mean)."""
    rec = {"step": step, "step_ms": round(seconds * 1e3, 3),
           "samples_per_s": round(global_batch / seconds, 2) if seconds > 0 else None}
    if peak_memory_bytes:
        rec["peak_memory_bytes"] = peak_memory_bytes
    if losses:
        rec["loss"] = weighted_mean(losses, weights)
        rec["micro_batches"] = len(losses)
    return rec


class Progress:
    """A tqdm bar over the steps (loss and samples/s), or nothing when disabled."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", mininterval=1.0,
                         dynamic_ncols=True) if enabled else None
        self._eval: str | None = None       # the latest held-out loss, shown until the next one

    def update(self, record: dict) -> None:
        if self._bar is None:
            return
        post = {}
        if "loss" in record:
            post["loss"] = f"{record['loss']:.4f}"
        if "eval_loss" in record:
            self._eval = f"{record['eval_loss']:.4f}"
        if self._eval is not None:
            post["eval"] = self._eval
        if record.get("samples_per_s"):
            post["samples/s"] = f"{record['samples_per_s']:.1f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def weighted_mean(values: list[float], weights: list[float] | None = None) -> float:
    """The mean of ``values`` (micro-batch losses), weighted by ``weights`` (their tokens) if given."""
    if weights is None:
        return sum(values) / len(values)
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total > 0 else math.nan
