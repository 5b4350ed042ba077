"""The simulator's timeline as a Chrome trace (Perfetto / chrome://tracing) and as a picture.

Trace layout follows the runtime's timelines so the two can be compared side by side: process
id = rank (named "rank r: stage s replica j", or "stages s, t, ..." for a rank holding several model
chunks), thread 0 the compute (forward / backward), thread
1 the transfers this rank sends, thread 2 its replica group's all-reduces. Times in microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.simulator import COMPUTE, SimResult

_THREADS = {"F": 0, "B": 0, "W": 0, "act": 1, "grad": 1, "allreduce": 2, "reduce_scatter": 2, "all_gather": 2}
_THREAD_NAMES = {0: "compute", 1: "send", 2: "all-reduce"}
COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B3", "act": "#C0C0C0", "grad": "#A0A0A0", "allreduce": "#DD8452",
           "reduce_scatter": "#C44E52", "all_gather": "#DA8BC3"}
SYNC_NAMES = {"allreduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}


def chrome_trace(result: SimResult, topo: Topology) -> dict:
    """The simulated intervals as a Chrome trace object."""
    events: list[dict] = []
    for rank in _ranks(topo):
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}: {_stages_text(topo, rank)} replica {topo.replica_of(rank)}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in _THREAD_NAMES.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    for iv in result.intervals:
        for pid in _pids(iv.where, topo):
            events.append({"ph": "X", "name": iv.label or iv.kind, "cat": iv.kind, "pid": pid,
                           "tid": _THREADS[iv.kind], "ts": iv.t0 * 1000, "dur": (iv.t1 - iv.t0) * 1000,
                           "args": {"micro_batch": iv.micro_batch, "stage": iv.stage, "where": iv.where}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"hybridpipe": {"simulated": True, "schedule": result.schedule, "steps": result.steps,
                                         "step_ms": result.step_ms}}}


def _ranks(topo: Topology) -> list[int]:
    return [r for rs in topo.groups for r in rs]


def _stages_text(topo: Topology, rank: int) -> str:
    stages = topo.stages_of(rank)
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


def shade(colour: str, chunk: int, chunks: int) -> str:
    """``colour`` for a rank's ``chunk``-th model chunk of ``chunks``: the first as is, later ones
    lighter (towards white), so the chunks of an interleaved or V schedule tell apart."""
    if chunks <= 1:
        return colour
    mix = 0.6 * chunk / (chunks - 1)
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def _pids(where: str, topo: Topology) -> list[int]:
    kind, _, rest = where.partition(" ")
    if kind == "rank":
        return [int(rest)]
    if kind == "link":
        return [int(rest.split("->")[0])]
    return list(topo.stage_ranks[int(rest.split()[0])])     # "stage s group"


def write_chrome_trace(result: SimResult, topo: Topology, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace(result, topo)))
    return p


def draw_timeline(result: SimResult, topo: Topology, path: str | os.PathLike, title: str = "",
                  until_ms: float | None = None) -> Path:
    """A Gantt chart of the simulated schedule: one row per rank, forwards blue, backwards green,
    weight gradients purple (labelled with the micro-batch), the replica group's all-reduces as an
    orange band (a sharded stage's reduce-scatters red, all-gathers pink). A rank holding V model
    chunks draws its later chunks lighter and labels each
    box ``m.c`` (micro-batch m, chunk c of the rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = _ranks(topo)
    V = topo.virtual_stages
    row = {r: i for i, r in enumerate(ranks)}
    end = until_ms if until_ms is not None else result.makespan_ms
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.5 * len(ranks)))
    for iv in result.intervals:
        if iv.t0 >= end:
            continue
        for pid in _pids(iv.where, topo):
            y = row[pid]
            if iv.kind in COMPUTE:
                chunk = topo.stages_of(pid).index(iv.stage) if V > 1 else 0
                ax.broken_barh([(iv.t0, iv.t1 - iv.t0)], (y - 0.4, 0.8), facecolors=shade(COLOURS[iv.kind], chunk, V),
                               edgecolors="white", linewidth=0.5)
                if (iv.t1 - iv.t0) > end / 150:
                    text = f"{iv.micro_batch}.{chunk}" if V > 1 else str(iv.micro_batch)
                    ax.text((iv.t0 + iv.t1) / 2, y, text, ha="center", va="center", fontsize=6,
                            color="white" if chunk < V / 2 else "black")
            elif iv.kind in SYNC_NAMES:
                ax.broken_barh([(iv.t0, iv.t1 - iv.t0)], (y + 0.4, 0.12), facecolors=COLOURS[iv.kind])
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (s{','.join(map(str, topo.stages_of(r)))})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time (ms)")
    for t in result.step_ends:
        if t <= end:
            ax.axvline(t, color="black", linewidth=0.6, linestyle=":")
    drawn = {iv.kind for iv in result.intervals}
    handles = [Patch(color=COLOURS[k], label=n) for k, n in
               (("F", "forward"), ("B", "backward (input)"), ("W", "weight gradients"), ("allreduce", "all-reduce"))]
    handles += [Patch(color=COLOURS[k], label=SYNC_NAMES[k]) for k in ("reduce_scatter", "all_gather") if k in drawn]
    if V > 1:
        handles += [Patch(color=shade(COLOURS["F"], v, V), label=f"chunk {v} (m.{v})") for v in range(V)]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=4 + (V if V > 1 else 0))
    ax.set_title(title or f"{result.schedule}: {result.step_ms:.3g} ms per step (simulated)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
