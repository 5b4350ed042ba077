"""Checkpoint files on disk: layout, atomic writes, the manifest, completeness, pruning, merging.

Layout of a checkpoint directory (``--checkpoint-dir DIR``)::

    DIR/step-000120/stage-0.pt      stage 0's weights + optimizer state (written by its replica 0)
    DIR/step-000120/stage-1.pt
    DIR/step-000120/rank-00003.pt   rank 3's own state: engine state (stashed weights), RNG states
    DIR/step-000120/manifest.json   written LAST, after every rank reported its files

``step-N`` holds the state after N completed steps (resume runs step N next). Every file is
written to a temporary name, fsynced, then renamed, and the manifest records each file's size
and SHA-256. A checkpoint is *complete* when its manifest exists and every file it lists exists
with the recorded size; a save killed half way leaves no manifest (or only temporary files), so
it is never picked. Stage files hold ordinary state_dicts whose keys are the model's own names
(the stage builder keeps them), so merging is a union of the stages' dicts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridpipe.errors import UserError

CHECKPOINT_KIND = "checkpoint"
CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def stage_file(stage: int) -> str:
    return f"stage-{stage}.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


@dataclass(frozen=True)
class FileRecord:
    """A written file: its name inside the step directory, size and SHA-256."""

    name: str
    bytes: int
    sha256: str


class _HashingWriter:
    """File wrapper that hashes and counts what torch.save writes through it."""

    def __init__(self, f) -> None:
        self.f, self.hash, self.count = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.count += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:         # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> FileRecord:
    """``torch.save`` to ``path`` atomically: temp file in the same directory, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            w = _HashingWriter(f)
            torch.save(obj, w)  # type: ignore[arg-type]  # any object with write() does (stub: IO[bytes])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return FileRecord(path.name, w.count, w.hash.hexdigest())


def write_manifest(root: str | os.PathLike, step: int, files: list[FileRecord], meta: dict) -> Path:
    """Write ``step``'s manifest (atomically, last): what makes the checkpoint complete."""
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"a file is listed twice in checkpoint step {step}: {sorted(names)}")
    data = {"kind": CHECKPOINT_KIND, "format": CHECKPOINT_FORMAT, "step": step, **meta,
            "files": {f.name: {"bytes": f.bytes, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)}}
    d = step_dir(root, step)
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(d)
    return d / MANIFEST


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of one step directory; UserError if missing or not a checkpoint manifest."""
    p = Path(directory) / MANIFEST
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"{p.parent} is not a complete checkpoint (no {MANIFEST}): it was interrupted "
                        "while saving; use an older step") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read checkpoint manifest {p}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != CHECKPOINT_KIND:
        raise UserError(f"{p} is not a hybridpipe checkpoint manifest")
    if data.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{p}: checkpoint format {data.get('format')!r} is not supported (this hybridpipe "
                        f"reads format {CHECKPOINT_FORMAT})")
    return data


def is_complete(directory: Path, n_stages: int | None = None, *, verify: bool = False) -> bool:
    """Manifest present and valid, every listed file present with its size (and SHA-256 if
    ``verify``), and one stage file per stage (``n_stages`` checked when given)."""
    try:
        m = read_manifest(directory)
    except UserError:
        return False
    files = m.get("files", {})
    stages = m.get("n_stages")
    if not isinstance(stages, int) or n_stages is not None and stages != n_stages:
        return False
    if any(stage_file(k) not in files for k in range(stages)):
        return False
    for name, rec in files.items():
        p = directory / name
        if not p.is_file() or p.stat().st_size != rec["bytes"]:
            return False
        if verify and sha256_of(p) != rec["sha256"]:
            return False
    return True


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def step_dirs(root: str | os.PathLike) -> dict[int, Path]:
    """Every ``step-N`` directory under ``root`` (complete or not), by step."""
    base = Path(root)
    if not base.is_dir():
        return {}
    found = {}
    for p in base.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return found


def complete_steps(root: str | os.PathLike, n_stages: int | None = None, *, verify: bool = False) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    return sorted(s for s, d in step_dirs(root).items() if is_complete(d, n_stages, verify=verify))


def latest_complete(root: str | os.PathLike, n_stages: int | None = None, *, verify: bool = False) -> int | None:
    """The newest step whose checkpoint is complete for ``n_stages`` stages, or None."""
    steps = complete_steps(root, n_stages, verify=verify)
    return steps[-1] if steps else None


def load_file(root: str | os.PathLike, step: int, name: str, *, verify: bool = True) -> dict:
    """Load one file of a complete checkpoint, checking its SHA-256 against the manifest."""
    d = step_dir(root, step)
    rec = read_manifest(d)["files"].get(name)
    if rec is None:
        raise UserError(f"checkpoint {d} has no {name}: it was written by a run with another plan "
                        "(other stages or world size); resume with that plan or start afresh")
    if verify and sha256_of(d / name) != rec["sha256"]:
        raise UserError(f"checkpoint file {d / name} is corrupt (SHA-256 differs from the manifest); "
                        f"delete {d} to resume from the previous checkpoint")
    return torch.load(d / name, map_location="cpu", weights_only=False)


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints, incomplete ones older than the
    newest complete one, and stray temporary files. ``keep`` <= 0 keeps every complete one."""
    dirs = step_dirs(root)
    complete = [s for s in sorted(dirs) if is_complete(dirs[s])]
    newest = complete[-1] if complete else None
    doomed = [s for s in complete[:-keep]] if keep > 0 else []
    doomed += [s for s in dirs if s not in complete and newest is not None and s < newest]
    removed = []
    for s in sorted(set(doomed)):
        shutil.rmtree(dirs[s], ignore_errors=True)
        removed.append(dirs[s])
    return removed


def remove_newer_than(root: str | os.PathLike, step: int) -> list[Path]:
    """Delete checkpoint directories after ``step`` (leftovers of an interrupted run's saves)."""
    removed = []
    for s, d in sorted(step_dirs(root).items()):
        if s > step:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def resolve_step(path: str | os.PathLike, step: int | None = None) -> tuple[Path, int]:
    """(checkpoint root, step) from a root (newest complete or ``step``) or a ``step-N`` directory."""
    p = Path(path)
    m = _STEP_DIR.match(p.name)
    if m and (p / MANIFEST).exists():
        if step is not None and step != int(m.group(1)):
            raise UserError(f"{p} is step {int(m.group(1))}, not --step {step}")
        return p.parent, int(m.group(1))
    if not p.is_dir():
        raise UserError(f"checkpoint directory {p} does not exist")
    steps = complete_steps(p)
    if not steps:
        raise UserError(f"{p} holds no complete checkpoint (step-N directories with a {MANIFEST}); "
                        "pass the run's --checkpoint-dir")
    if step is None:
        return p, steps[-1]
    if step not in steps:
        raise UserError(f"{p} has no complete checkpoint for step {step}; complete steps: "
                        f"{', '.join(map(str, steps))}")
    return p, step


def merge_stages(root: str | os.PathLike, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """One state_dict of the whole model from every stage file of ``step`` (and the manifest).

    Keys must be disjoint across stages unless they hold equal tensors (a weight shared by two
    stages); anything else is an error naming the key.
    """
    manifest = read_manifest(step_dir(root, step))
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for k in range(manifest["n_stages"]):
        state = load_file(root, step, stage_file(k))["model"]
        for key, value in state.items():
            if key in merged and not torch.equal(merged[key], value):
                raise UserError(f"stages {owner[key]} and {k} both hold {key!r} with different values; "
                                "this checkpoint cannot be merged into one state_dict")
            merged.setdefault(key, value)
            owner.setdefault(key, k)
    return merged, manifest
