"""On the CPU, keep freed memory for the next micro-batch instead of handing it back to the kernel.

    applied = keep_freed_memory()     # once per process, before training (the Trainer does it on the CPU)

glibc's malloc serves an allocation above its mmap threshold (128 KiB at first, raised as large
blocks are freed, to at most 32 MiB) with a fresh mapping that it unmaps when freed, and gives the
free top of a heap back to the kernel once it exceeds the trim threshold (twice the mmap
threshold). A training step allocates its activations in the forwards and frees them in the
backwards, every micro-batch, so without help those bytes come back as fresh pages each time: a
page fault and a zeroed page per 4 KiB, CPU time in the kernel on the step's thread. PyTorch's
CUDA caching allocator keeps freed blocks for reuse on a GPU; this does the same for glibc on the
CPU (``mallopt``): blocks up to 32 MiB come from the heap, and up to 2 GiB of free heap stays with
the process. The process keeps the footprint of its peak, which every step reaches anyway.

Nothing is changed where the user chose the allocator's behaviour: a ``MALLOC_*`` environment
variable or glibc tunables (``GLIBC_TUNABLES``), another allocator preloaded (``LD_PRELOAD``, e.g.
jemalloc or tcmalloc), or a C library that is not glibc. ``TrainingConfig.cpu_allocator="system"``
(``--cpu-allocator system``) leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

ALLOCATORS = ("keep", "system")            # TrainingConfig.cpu_allocator
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20                            # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1                       # mallopt takes an int: 2 GiB


def chosen_elsewhere(env: Mapping[str, str]) -> str | None:
    """Why the allocator is the user's to set (an environment variable that says so), else None."""
    for name in sorted(env):
        if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES" or (name == "LD_PRELOAD" and env[name].strip()):
            return name
    return None


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    return libc


def keep_freed_memory(env: Mapping[str, str] | None = None) -> str:
    """Set glibc's thresholds so freed blocks stay for reuse (see the module docstring); what was
    done, as one phrase: ``kept`` or why not (``LD_PRELOAD set``, ``not glibc``, ...)."""
    why = chosen_elsewhere(os.environ if env is None else env)
    if why is not None:
        return f"{why} set"
    libc = _glibc()
    if libc is None:
        return "not glibc"
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return "kept" if ok else "mallopt refused"
