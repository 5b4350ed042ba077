"""Timing a piece of work on a device: median of repeats after warm-up.

On CPU the clock is ``time.perf_counter``; on CUDA the work is bracketed by CUDA events on the
current stream after a ``torch.cuda.synchronize()``, so queued work from the untimed
preparation never leaks into the measurement.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(run: Callable[[Any], Any], *, prepare: Callable[[], Any] = lambda: None,
              device: torch.device | str = "cpu", repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of ``run(prepare())`` over ``repeats`` timed calls after ``warmup`` untimed ones.

    ``prepare`` is called (untimed) before every call and its result passed to ``run``: it
    builds what ``run`` consumes, e.g. a fresh forward graph for a timed backward.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cuda = torch.device(device).type == "cuda"
    samples = []
    for i in range(warmup + repeats):
        state = prepare()
        ms = _time_cuda(run, state) if cuda else _time_cpu(run, state)
        if i >= warmup:
            samples.append(ms)
    return statistics.median(samples)


def _time_cpu(run: Callable[[Any], Any], state: Any) -> float:
    t0 = time.perf_counter()
    run(state)
    return (time.perf_counter() - t0) * 1e3


def _time_cuda(run: Callable[[Any], Any], state: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    run(state)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
