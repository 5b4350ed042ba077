"""Test-wide settings: Hugging Face models are built from tiny configs, never downloaded; torch
runs its operations on one thread in the test process, as in every rank the tests launch."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # also inherited by launched ranks and CLI subprocesses
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The in-process pipelines run one thread per rank; each one's operations on tiny tensors woke an
# OpenMP team of its own (two threads per rank on a 2-core machine), whose spin-waits burned 2.5x
# the CPU (measured on test_virtual.py's 12 chunked pipelines: 22.5 s of CPU with 2 threads, 8.5 s
# with 1). The ranks the tests launch run with OMP_NUM_THREADS=1 (tests/runtime/jobs.py).
torch.set_num_threads(1)
