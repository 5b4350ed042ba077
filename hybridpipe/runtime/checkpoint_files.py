"""Checkpoint files on disk: layout, atomic writes, the manifest, completeness, pruning (merging: merged.py).

Layout of a checkpoint directory (``--checkpoint-dir DIR``)::

    DIR/step-000120/stage-0.pt      stage 0's weights + optimizer state, under the model's names
                                    (written by its replica 0; runtime/reshard.py)
    DIR/step-000120/stage-1.pt
    DIR/step-000120/rank-00003.pt   rank 3's own state: engine state (stashed weights), RNG states
    DIR/step-000120/manifest.json   written LAST, after every rank reported its files; holds the
                                    plan (for information), an index: name -> stage file, and each
                                    replica's digests of its copy (name -> SHA-256; replicated stages)

``step-N`` holds the state after N completed steps (resume runs step N next). A save writes
into ``DIR/.step-N.TAG.tmp/`` (TAG: the job's; every file to a temporary name, fsynced, renamed), the manifest
records each file's size and SHA-256, and the whole directory is renamed to ``step-N`` at the
end (:func:`commit`): a save killed half way leaves only the ``.tmp`` directory, never a
``step-N``. A checkpoint is *complete* when its manifest exists and every file it lists exists
with the recorded size. Stage files hold ordinary state_dicts whose keys are the model's own
names (the stage builder keeps them; a tied parameter once, under its first name, by the lowest
stage that reads it) and the optimizer state keyed by the same names, so merging is a union of
the stages' dicts, and any other plan of the model picks the names it needs (resharding).

Checkpoints are data, not code: every file is read with ``torch.load(weights_only=True)``
(tensors, numbers, strings, lists, dicts only), so a shard replaced by a pickle that would run a
command is refused with one line and never executed. The manifest is read with the project's
JSON loader and every field it uses is type-checked.

Each manifest names its *lineage* (a training run and the runs resumed from it); pruning
(checkpoint_prune.py) only ever deletes checkpoints of the lineage that is writing, never anyone else's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import atomic_file, field, fsync_dir, parse_json

CHECKPOINT_KIND = "checkpoint"
CHECKPOINT_FORMAT = 2          # 2: name-keyed optimizer state, tied parameters once, an "index"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STAGING = re.compile(r"^\.step-(\d+)(?:\.[A-Za-z0-9_-]+)?\.tmp$")
_TAG = re.compile(r"^[A-Za-z0-9_-]*$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def staging_dir(root: str | os.PathLike, step: int, tag: str = "") -> Path:
    """Where a save of ``step`` writes until :func:`commit` renames it to :func:`step_dir`:
    ``.step-N.TAG.tmp``, ``tag`` naming the job (unique per job, so two jobs never share one)."""
    if not _TAG.match(tag):
        raise ValueError(f"a staging tag is letters, digits, '_' and '-' only, got {tag!r}")
    return Path(root) / (f".step-{step:06d}.{tag}.tmp" if tag else f".step-{step:06d}.tmp")


def staging_dirs(root: str | os.PathLike) -> dict[Path, int]:
    """Every staging directory under ``root`` (a save or a deletion cut short, or in progress), with its step."""
    base = Path(root)
    if not base.is_dir():
        return {}
    return {p: int(m.group(1)) for p in base.iterdir() if (m := _STAGING.match(p.name)) and p.is_dir()}


def set_aside(path: Path, kind: str) -> Path:
    """Rename ``path`` (a ``step-N`` directory) to ``step-N.KIND-K`` (the first K free); the new path."""
    k = 1
    while (path.parent / f"{path.name}.{kind}-{k}").exists():
        k += 1
    aside = path.parent / f"{path.name}.{kind}-{k}"
    os.rename(path, aside)
    return aside


def stage_file(stage: int) -> str:
    return f"stage-{stage}.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


class NotPlainData(UserError):
    """A checkpoint file whose bytes match its manifest but which is not plain tensor data: it
    was replaced (or written by something else); never loaded, never resumed from."""


@dataclass(frozen=True)
class FileRecord:
    """A written file: its name inside the step directory, size and SHA-256."""

    name: str
    bytes: int
    sha256: str


class _HashingWriter:
    """File wrapper that hashes and counts what torch.save writes through it; keeps the first
    OSError (torch's zip writer hides it behind its own "unexpected pos" error)."""

    def __init__(self, f: Any = None) -> None:
        self.f, self.hash, self.count = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.hash.update(data)
        self.count += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj: Any, path: Path) -> FileRecord:
    """``torch.save`` to ``path`` atomically and durably (``jsonfile.atomic_file``); its size and hash.
    A path that cannot be written (a full disk included) is a one-line UserError."""
    w = _HashingWriter()
    try:
        with atomic_file(path, "wb", durable=True) as f:
            w.f = f
            torch.save(obj, w)  # type: ignore[arg-type]  # any object with write() does (stub: IO[bytes])
    except Exception as e:
        cause = None if isinstance(e, UserError) else w.error
        if cause is not None:           # e.g. ENOSPC: torch.save ends with "unexpected pos N vs M" instead
            raise UserError(f"cannot write {path}: {cause.strerror or cause}") from None
        raise
    return FileRecord(path.name, w.count, w.hash.hexdigest())


def write_manifest(directory: str | os.PathLike, step: int, files: list[FileRecord], meta: dict) -> Path:
    """Write ``step``'s manifest into ``directory`` (atomically, last): what makes the checkpoint
    complete once the directory is committed."""
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"a file is listed twice in checkpoint step {step}: {sorted(names)}")
    data = {"kind": CHECKPOINT_KIND, "format": CHECKPOINT_FORMAT, "step": step, **meta,
            "files": {f.name: {"bytes": f.bytes, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)}}
    d = Path(directory)
    with atomic_file(d / MANIFEST, durable=True) as f:
        json.dump(data, f, indent=1)
    return d / MANIFEST


def commit(root: str | os.PathLike, step: int, keep_files: set[str], tag: str = "") -> tuple[Path, Path | None]:
    """Rename the staging directory of ``step`` (``tag``: :func:`staging_dir`) to ``step-N`` (the
    checkpoint appears whole).

    Files in the staging directory that the manifest does not list (left by an earlier save of
    the same step that was killed) are removed first. A ``step-N`` that already exists (an
    unusable checkpoint a resumed run skipped) is never overwritten: it is renamed aside to
    ``step-N.skipped-K``, which is returned second."""
    staging, final = staging_dir(root, step, tag), step_dir(root, step)
    for p in staging.iterdir():
        if p.name not in keep_files and p.name != MANIFEST and p.is_file():
            p.unlink(missing_ok=True)
    aside = set_aside(final, "skipped") if final.exists() or final.is_symlink() else None
    os.rename(staging, final)
    fsync_dir(final.parent)
    return final, aside


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of one step directory, its fields type-checked (``files`` maps each name to
    ``{"bytes": int, "sha256": str}``); UserError if missing, unreadable or malformed."""
    p = Path(directory) / MANIFEST
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(f"{p.parent} is not a complete checkpoint (no {MANIFEST}): it was interrupted "
                        "while saving; use an older step") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read checkpoint manifest {p}: {getattr(e, 'strerror', None) or e}") from None
    data = parse_json(text, f"checkpoint manifest {p}")
    if not isinstance(data, dict) or data.get("kind") != CHECKPOINT_KIND:
        raise UserError(f"{p} is not a hybridpipe checkpoint manifest")
    if data.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{p}: checkpoint format {data.get('format')!r} is not supported (this hybridpipe "
                        f"reads format {CHECKPOINT_FORMAT}; format 1 was keyed by stage: resume or merge it with "
                        "the hybridpipe that wrote it)")
    where = f"checkpoint manifest {p}"
    field(data, "step", int, where, minimum=0)
    field(data, "n_stages", int, where, minimum=1)
    field(data, "model", str, where)
    field(data, "lineage", str, where, default="")
    for name, rec in field(data, "files", dict, where).items():
        if "/" in name or name in ("", ".", ".."):
            raise UserError(f"{where}: file name {name!r} is not a plain name inside the checkpoint")
        field(rec, "bytes", int, f"{where}: file {name}", minimum=0)
        field(rec, "sha256", str, f"{where}: file {name}")
    for i, names in enumerate(field(data, "tied", list, where, default=[])):
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"{where}: tied group {i} must be a list of parameter names, got {names!r}")
    for stage, copies in field(data, "replicas", dict, where, default={}).items():
        if not isinstance(copies, dict) or not all(isinstance(named, dict) and all(
                isinstance(v, str) for v in named.values()) for named in copies.values()):
            raise UserError(f"{where}: \"replicas\" of stage {stage} must map each rank to {{name: digest}}")
    return data


def why_incomplete(directory: Path, n_stages: int | None = None, *, verify: bool = False) -> str:
    """Why ``directory`` is not a complete checkpoint ("" when it is): manifest present and
    valid, every listed file present with its size (and SHA-256 if ``verify``), one stage file
    per stage (``n_stages`` checked when given)."""
    try:
        m = read_manifest(directory)
    except UserError as e:
        return str(e)
    files = m["files"]
    stages = m["n_stages"]
    if n_stages is not None and stages != n_stages:
        return f"it holds {stages} stages, not {n_stages}"
    missing = [stage_file(k) for k in range(stages) if stage_file(k) not in files]
    if missing:
        return f"its manifest lists no {missing[0]}"
    for name, rec in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != rec["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, not the {rec['bytes']} its manifest records"
        if verify and sha256_of(p) != rec["sha256"]:
            return f"{name} is corrupt (its SHA-256 differs from the manifest's)"
    return ""


def is_complete(directory: Path, n_stages: int | None = None, *, verify: bool = False) -> bool:
    """Whether ``directory`` is a complete checkpoint (see :func:`why_incomplete`)."""
    return not why_incomplete(directory, n_stages, verify=verify)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_fresh(root: str | os.PathLike, *, named: str, hint: str) -> None:
    """A fresh run never writes into checkpoints it did not make: UserError (``named``: how the
    directory is called, ``hint``: what to do) when ``root`` holds any step directory."""
    found = sorted(step_dirs(root).values())
    if found:
        more = " ..." if len(found) > 3 else ""
        raise UserError(f"{named} already holds checkpoints ({', '.join(p.name for p in found[-3:])}{more}); {hint}")


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
    """Load one file of a complete checkpoint, checking its SHA-256 against the manifest, as
    data only (``weights_only=True``): a file that is not plain tensors and containers is a
    one-line UserError, and nothing in it runs."""
    d = step_dir(root, step)
    rec = read_manifest(d)["files"].get(name)
    if rec is None:
        raise UserError(f"checkpoint {d} has no {name}: it was written by a run with another plan "
                        "(other stages or world size); resume with that plan or start afresh")
    if verify and sha256_of(d / name) != rec["sha256"]:
        raise UserError(f"checkpoint file {d / name} is corrupt (its SHA-256 differs from the manifest's)")
    return load_data(d / name)


def load_data(path: Path) -> dict:
    """``torch.load(path, weights_only=True)`` to the CPU; anything else than a dict of plain data
    (a foreign pickle, a truncated or garbled file) is a one-line UserError."""
    try:
        with warnings.catch_warnings():             # torch warns about foreign pickles: the error says it
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UserError(f"cannot read checkpoint file {path}: {e.strerror or e}") from None
    except Exception as e:      # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...: not our data
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise NotPlainData(f"checkpoint file {path} is not plain tensor data and was not loaded "
                        f"({type(e).__name__}: {first[:200]}); it is damaged or was replaced: "
                        "use a checkpoint you trust") from None
    if not isinstance(data, dict):
        raise UserError(f"checkpoint file {path} holds a {type(data).__name__}, not a hybridpipe checkpoint part")
    return data


def lineage_of(directory: Path) -> str:
    """The lineage recorded in a checkpoint's manifest ("" when none or unreadable)."""
    try:
        return str(read_manifest(directory).get("lineage", ""))
    except UserError:
        return ""


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
