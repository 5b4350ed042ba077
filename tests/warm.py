"""Loaded once by the test session's fork server (tests/forked.py) before it forks any process:
what the ranks import, and torch.export's first capture (it imports dynamo and sympy) and a Hugging Face
model's, so that no forked rank pays them. Torch's random generator is left at its default seed, as a new
process has it."""

from __future__ import annotations

import contextlib
import sys

import pytest  # noqa: F401  (multiprocessing re-runs the parent's ``python -m pytest`` main module in each child)
import torch
import torch.distributed

import hybridpipe.cli  # noqa: F401
import hybridpipe.comm.p2p  # noqa: F401
import hybridpipe.launch  # noqa: F401
import hybridpipe.runtime.worker  # noqa: F401
import tests.runtime.jobs  # noqa: F401
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.zoo import resolve_model

with contextlib.suppress(ImportError):
    import transformers  # noqa: F401


def _first_capture() -> None:
    """torch.export's first capture; with transformers, a Hugging Face model's first too (its modeling code
    imported and traced once: 2.6 s of CPU in a forked rank, 1.3-1.5 s after this, measured on GPT-2)."""
    state = torch.get_rng_state()
    specs = ["mlp"]
    if "transformers" in sys.modules:
        specs.append("hf:gpt2[n_layer=1,n_embd=8,n_head=2,vocab_size=16,seq=4,dropout=0]")
    for name in specs:
        spec = resolve_model(name)
        capture_model(spec.build(), spec.example_input(2))
    torch.set_rng_state(state)


_first_capture()
