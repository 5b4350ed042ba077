"""Merging the ranks' traces (timeline.py) into one Chrome trace, and the per-phase time table.

Pure functions over the loaded files; ``hybridpipe timeline`` does the I/O and the picture.

Clock alignment: when every rank aligned its clock on a barrier (``clock == "barrier"``), time 0
is the same instant on all of them (within one network latency) and the files are merged as
they are. Otherwise (a rank recorded without a process group) ranks are placed by their wall
clocks, which is as good as the hosts' clock synchronisation (NTP: about a millisecond).
Finally everything is shifted so that the earliest event starts at 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hybridpipe.errors import UserError
from hybridpipe.runtime.timeline import PHASES, TID_PHASES, TID_STEPS, RankTrace

MERGED_KIND = "timeline"


def merge_traces(traces: list[RankTrace]) -> dict:
    """One Chrome trace holding every rank as its own process row (pid = rank)."""
    if not traces:
        raise UserError("no rank traces to merge")
    seen: dict[int, RankTrace] = {}
    for t in traces:
        if t.rank in seen:
            raise UserError(f"rank {t.rank} has two trace files ({seen[t.rank].path} and {t.path}); "
                            "merge the traces of one run only")
        seen[t.rank] = t
    ordered = [seen[r] for r in sorted(seen)]
    barrier = all(t.meta.get("clock") == "barrier" for t in ordered)
    first_wall = min(float(t.meta["anchor_wall_s"]) for t in ordered)
    offsets = {t.rank: 0.0 if barrier else (float(t.meta["anchor_wall_s"]) - first_wall) * 1e6 for t in ordered}
    for t in ordered:
        for e in t.events:
            if e.get("pid") != t.rank:
                raise UserError(f"{t.path}: an event has pid {e.get('pid')} but the file is rank {t.rank}'s")
    start = min((e["ts"] + offsets[t.rank] for t in ordered for e in t.events if e.get("ph") == "X"), default=0.0)
    events = []
    for t in ordered:
        for e in t.events:
            if e.get("ph") == "X":
                e = dict(e, ts=round(e["ts"] + offsets[t.rank] - start, 3))
            events.append(e)
    world = max(int(t.meta.get("world_size", 0)) for t in ordered)
    missing = sorted(set(range(world)) - set(seen))
    info = {"kind": MERGED_KIND, "clock": "barrier" if barrier else "wall clock", "ranks": [t.meta for t in ordered],
            "world_size": world, "missing_ranks": missing}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"hybridpipe": info}}


@dataclass(frozen=True)
class PhaseRow:
    """One rank's time per step: mean step time and the mean time of each phase in a step (ms)."""

    rank: int
    stage: int
    replica: int
    steps: int
    step_ms: float
    phase_ms: dict[str, float]
    stages: tuple[int, ...] = ()        # every model chunk of the rank (virtual stages); () = (stage,)

    @property
    def stage_label(self) -> str:
        """``3``, or a rank's chunks ``0,3``."""
        return ",".join(map(str, self.stages or (self.stage,)))

    @property
    def compute_share(self) -> float:
        """Fraction of the step spent computing (forward, backward, optimizer step)."""
        busy = sum(self.phase_ms.get(p, 0.0) for p in ("run_for", "run_back", "step"))
        return busy / self.step_ms if self.step_ms > 0 else 0.0


def phase_table(merged: dict) -> list[PhaseRow]:
    """Per rank: the mean duration of each phase per step, from a merged trace."""
    info = merged["otherData"]["hybridpipe"]
    totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    steps: dict[int, set] = defaultdict(set)
    step_us: dict[int, list[float]] = defaultdict(list)
    for e in merged["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e.get("tid") == TID_PHASES:
            totals[e["pid"]][e["name"]] += e["dur"]
            if e["args"].get("step") is not None:
                steps[e["pid"]].add(e["args"]["step"])
        elif e.get("tid") == TID_STEPS:
            step_us[e["pid"]].append(e["dur"])
    rows = []
    for meta in info["ranks"]:
        r = int(meta["rank"])
        n = max(len(steps[r]), 1)
        rows.append(PhaseRow(rank=r, stage=int(meta["stage"]), replica=int(meta["replica"]), steps=len(steps[r]),
                             step_ms=sum(step_us[r]) / len(step_us[r]) / 1e3 if step_us[r] else 0.0,
                             phase_ms={p: totals[r].get(p, 0.0) / n / 1e3 for p in PHASES},
                             stages=tuple(int(s) for s in meta.get("stages", ()))))
    return rows


def step_window(merged: dict, last: int) -> tuple[int, int] | None:
    """The range (first, last) of the newest ``last`` step numbers that every rank recorded."""
    per_rank: dict[int, set] = defaultdict(set)
    for e in merged["traceEvents"]:
        if e.get("ph") == "X" and e.get("tid") == TID_PHASES and e["args"].get("step") is not None:
            per_rank[e["pid"]].add(e["args"]["step"])
    if not per_rank:
        return None
    common = sorted(set.intersection(*per_rank.values())) or sorted(set.union(*per_rank.values()))
    chosen = common[-last:] if last > 0 else common
    return chosen[0], chosen[-1]
