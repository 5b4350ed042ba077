"""Random numbers a model's forward draws on the host (numpy's and Python's global generators) while
it is captured: torch.export records the values drawn as constants, so the captured graph would
replay the capture's draw at every step (Wav2Vec2's SpecAugment time mask, ``np.random`` in
``_compute_mask_indices``: one fixed mask for the whole run) where the model itself draws anew.
:func:`host_draws` records each such call with the model code's line that made it."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

TORCH = os.path.dirname(torch.__file__) + os.sep
NUMPY = ("rand", "randn", "randint", "random", "random_sample", "ranf", "sample", "uniform", "normal", "choice",
         "permutation", "shuffle", "binomial", "poisson", "beta", "exponential", "standard_normal", "integers")
PYTHON = ("random", "randint", "randrange", "uniform", "choice", "choices", "shuffle", "sample", "gauss",
          "normalvariate", "betavariate", "expovariate")


@contextlib.contextmanager
def host_draws() -> Iterator[list[str]]:
    """Within the block, every call of numpy's or Python's global random functions is appended to the
    yielded list as ``"numpy.random.rand at FILE:LINE"`` (the first caller outside numpy and random;
    calls from torch's own code are left out)."""
    drawn: list[str] = []
    patched: list[tuple[Any, str, Callable]] = []
    modules: list[tuple[Any, str, tuple[str, ...]]] = [(random, "random", PYTHON)]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        modules.append((numpy.random, "numpy.random", NUMPY))
    for module, label, names in modules:
        for name in names:
            original = getattr(module, name, None)
            if callable(original):
                patched.append((module, name, original))
                setattr(module, name, _recording(original, f"{label}.{name}", drawn))
    try:
        yield drawn
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _recording(original: Callable, label: str, drawn: list[str]) -> Callable:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        where = _caller()
        if not where.startswith(TORCH):          # torch's own machinery (export's tracing) is not the model
            drawn.append(f"{label} at {where}")
        return original(*args, **kwargs)
    return call


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and ("numpy" in frame.f_code.co_filename or frame.f_code.co_filename == random.__file__):
        frame = frame.f_back      # type: ignore[assignment]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
