"""A real text corpus on every machine: the Python standard library's own source files, as bytes.

    train = python_stdlib(split="train", seq=64)       # (input, target) pairs of byte ids 0..255
    held_out = python_stdlib(split="held-out", seq=64)

Every ``Lib/**/*.py`` file of the running interpreter (``sysconfig``'s ``stdlib``, tests and
site-packages left out), in sorted path order. A file belongs to the held-out split when the
SHA-256 of its relative path falls in the lowest ``held_out`` fraction (a stable, seed-free
split: the same files on every machine with the same Python). Sample i of a split is the window
of ``seq + 1`` bytes at offset ``i * seq`` of the split's concatenated files: the input is its
first ``seq`` bytes, the target the ``seq`` bytes after each (next-byte prediction, for the
zoo's ``gpt[vocab=256,seq=...]``). For launch: ``--dataset hybridpipe.profiles.corpus:python_stdlib[seq=64]``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from hybridpipe.errors import UserError

SPLITS = ("train", "held-out")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files (no tests, no site-packages), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def in_held_out(relative: str, fraction: float) -> bool:
    """Whether a file (by its path relative to the library) is held out."""
    h = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class ByteCorpus(Dataset):
    """Windows of a byte string as (input, target) int64 tensors (see the module docstring)."""

    def __init__(self, data: bytes, seq: int) -> None:
        if len(data) < seq + 1:
            raise UserError(f"the corpus has {len(data)} bytes, too few for one sample of {seq + 1}")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        w = self.data[i * self.seq:i * self.seq + self.seq + 1].long()
        return w[:-1], w[1:]


def python_stdlib(split: str = "train", seq: int = 64, held_out: float = 0.05, max_mb: float = 0.0,
                  root: str = "") -> ByteCorpus:
    """The ``split`` of the standard library's sources as a :class:`ByteCorpus` (``max_mb`` > 0
    keeps only that many megabytes; ``root`` another library directory)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if not 0 < held_out < 1:
        raise UserError(f"held_out must be a fraction in (0, 1), got {held_out}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    if not files:
        raise UserError(f"no Python files under {base}; pass root=DIR of a Python library")
    parts = []
    for p in files:
        if in_held_out(p.relative_to(base).as_posix(), held_out) == (split == "held-out"):
            parts.append(p.read_bytes())
    data = b"\n".join(parts)
    if max_mb > 0:
        data = data[:int(max_mb * 2**20)]
    return ByteCorpus(data, seq)
