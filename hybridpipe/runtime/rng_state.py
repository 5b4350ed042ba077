"""A process's random number generators as plain data (saved in each rank's checkpoint file)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict:
    """This process's RNG states as plain data: torch CPU (and CUDA when present) as tensors,
    Python's and NumPy's Mersenne Twisters as lists of ints and floats."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
                             "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back the RNG states of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed(seed: int, rank: int, step: int) -> None:
    """A rank's torch RNG after a reshard (its saved stream belonged to another rank's part):
    seeded from (seed, rank, step), so a rerun of the same restart draws the same numbers."""
    torch.manual_seed(int(np.random.SeedSequence((seed, rank, step)).generate_state(1, np.uint64)[0]))
