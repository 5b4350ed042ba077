"""What a restarted job knows about the attempt before it (elastic restarts under torchrun).

A worker that stops through the failure guard (another rank died: exit 75) leaves a note in
the checkpoint directory, ``DIR/restarts/exit-<rank>.json``: when it stopped, the world size
and the steps completed. The next attempt that resumes turns the notes into one restart
record (:func:`restart_entry`): world size before and after, the step it resumed from, the
steps re-done, and when its first step completed, seconds since the failure was detected,
split into the time until this worker process started (rendezvous, process start-up), the
re-planning and the checkpoint load. The reporting rank appends it to ``DIR/restarts.json``
(every restart of the run, in order; the summary lists them) and removes the notes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hybridpipe.jsonfile import write_json

NOTES = "restarts"
LOG = "restarts.json"


def note_exit(root: str | os.PathLike, rank: int, world_size: int, steps_done: int) -> None:
    """Leave this rank's exit note (quick and local: called while the process exits)."""
    d = Path(root) / NOTES
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".exit-{rank}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"time": time.time(), "rank": rank, "world_size": world_size,
                               "steps_done": steps_done}))
    os.replace(tmp, d / f"exit-{rank}.json")


def read_notes(root: str | os.PathLike) -> list[dict]:
    """The exit notes of the previous attempt (unreadable ones are left out)."""
    notes = []
    for p in sorted((Path(root) / NOTES).glob("exit-*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and all(isinstance(data.get(k), int | float) for k in
                                          ("time", "world_size", "steps_done")):
            notes.append(data)
    return notes


def restart_entry(notes: list[dict], *, world_size: int, resumed_from: int, started: float,
                  planning_s: float, load_s: float, stages: dict[str, float] | None = None) -> dict | None:
    """The restart record of this attempt (None when the previous one left no note); the
    first step's fields are filled in by :func:`first_step_done`. ``stages`` maps the worker's
    milestones to their times (``imports_s``: Python started and imported launch, ``process_group_s``:
    every rank joined, ``config_s``: the plan made and the configuration agreed, ``model_s``: model
    built and captured, ``job_s``: stages, optimizer, process groups and channels up, the checkpoint
    load next; a worker run without launch has no ``process_group_s`` and ``config_s``, its
    ``imports_s`` ends where the worker began): each becomes the seconds since the previous one,
    from the process start."""
    if not notes:
        return None
    failed = min(n["time"] for n in notes)
    done = max(int(n["steps_done"]) for n in notes)
    parts, last = {}, started
    for name, when in (stages or {}).items():
        parts[name] = round(when - last, 3)
        last = when
    return {"kind": "restart", **parts, "world_size_before": int(max(n["world_size"] for n in notes)),
            "world_size_after": world_size,
            "failure_detected_at": round(failed, 3), "resumed_from_step": resumed_from,
            "steps_redone": max(0, done - resumed_from),
            "seconds_to_worker_start": round(started - failed, 3), "planning_s": round(planning_s, 3),
            "checkpoint_load_s": round(load_s, 3)}


def first_step_done(entry: dict, step_s: float, now: float | None = None) -> dict:
    """``entry`` with the seconds from the failure to the end of the first step after it (and
    that step's own duration, ``step_s``)."""
    now = time.time() if now is None else now
    return {**entry, "first_step_s": round(step_s, 3),
            "seconds_to_first_step": round(now - entry["failure_detected_at"], 3)}


def append_log(root: str | os.PathLike, entry: dict) -> list[dict]:
    """Add ``entry`` to ``DIR/restarts.json``, remove the notes it came from; every entry so far."""
    entries = read_log(root)
    entries.append(entry)
    write_json(Path(root) / LOG, {"restarts": entries})
    for p in (Path(root) / NOTES).glob("exit-*.json"):
        p.unlink(missing_ok=True)
    return entries


def read_log(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Every restart recorded for the run in ``root`` (oldest first)."""
    try:
        data = json.loads((Path(root) / LOG).read_text())
    except (OSError, ValueError):
        return []
    found = data.get("restarts") if isinstance(data, dict) else None
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def process_start_time() -> float:
    """When this process was started (epoch seconds; Linux /proc), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
