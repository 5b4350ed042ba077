"""Test-wide settings: Hugging Face models are built from tiny configs, never downloaded; torch
runs its operations on one thread in the test process, as in every rank the tests launch."""

from __future__ import annotations

import gc
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # also inherited by launched ranks and CLI subprocesses
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The in-process pipelines run one thread per rank; each one's operations on tiny tensors woke an
# OpenMP team of its own (two threads per rank on a 2-core machine), whose spin-waits burned 2.5x
# the CPU (measured on test_virtual.py's 12 chunked pipelines: 22.5 s of CPU with 2 threads, 8.5 s
# with 1). The ranks the tests launch run with OMP_NUM_THREADS=1 (tests/runtime/jobs.py).
torch.set_num_threads(1)

# The test process holds hundreds of thousands of long-lived objects (torch, dynamo, sympy, transformers,
# the shared captures), and Python's default thresholds (700, 10, 10) collected the young generation
# ~3000 times over tests/profiles + test_hf_pipeline.py: 4.7 s of their 47 s of CPU in the collector,
# 2.1 s with these thresholds (and what collection imported frozen out of the scans). Garbage in
# cycles lives a little longer: tests/allocator.py's peaks run in a fresh process, and the in-process
# memory tests (pipeline/test_memory*.py, profiles/test_transient.py) pass unchanged with it.
gc.set_threshold(10_000, 50, 50)


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()
