"""``hybridpipe timeline RUN_DIR -o timeline.json [--png timeline.png]``.

Merges the per-rank Chrome traces a run wrote (``RUN_DIR/trace/rank-*.json``, see
hybridpipe/runtime/timeline.py) into one trace with one process row per rank (open it in
https://ui.perfetto.dev or chrome://tracing), prints the mean time of every phase per step for
each rank, and optionally draws a Gantt picture of the newest steps with one colour per phase.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hybridpipe.argtypes import check_output_file, nonneg_int, output_file
from hybridpipe.commands.show import table
from hybridpipe.jsonfile import write_text
from hybridpipe.runtime.timeline import PHASES, TID_PHASES, TID_TRANSFERS, find_rank_traces, load_rank_trace
from hybridpipe.runtime.timeline_merge import merge_traces, phase_table, step_window

log = logging.getLogger(__name__)

# one fixed colour per phase (matplotlib's tab10), so pictures of different runs compare
PHASE_COLOURS = dict(zip(PHASES, ("#1f77b4", "#2ca02c", "#17becf", "#9467bd", "#d62728", "#ff7f0e",
                                  "#e377c2", "#7f7f7f"), strict=True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run's directory (holding trace/rank-*.json) or the trace directory")
    parser.add_argument("-o", "--output", type=output_file, default=None,
                        help="merged Chrome trace to write (default RUN_DIR/timeline.json)")
    parser.add_argument("--png", type=output_file, default=None, metavar="FILE",
                        help="also draw a Gantt picture of the newest steps")
    parser.add_argument("--png-steps", type=nonneg_int, default=4, metavar="N",
                        help="how many of the newest steps the picture shows (0: all kept steps; default 4)")


def run(args: argparse.Namespace) -> int:
    out = check_output_file(args.output or Path(args.run_dir) / "timeline.json", "timeline")
    traces = [load_rank_trace(p) for p in find_rank_traces(args.run_dir)]
    merged = merge_traces(traces)
    info = merged["otherData"]["hybridpipe"]
    write_text(out, json.dumps(merged, separators=(",", ":")))
    print(f"merged {len(traces)} ranks ({info['clock']} aligned) into {out}")
    if info["missing_ranks"]:
        print(f"warning: no trace from rank(s) {', '.join(map(str, info['missing_ranks']))} "
              "(a rank that was killed writes none)")
    print(render_phase_table(merged))
    if args.png:
        draw_gantt(merged, Path(args.png), last_steps=args.png_steps)
        print(f"wrote {args.png}")
    return 0


def render_phase_table(merged: dict) -> str:
    """Per rank: mean step time and mean time per step of every phase (ms)."""
    rows = phase_table(merged)
    body = [[r.rank, r.stage_label, r.replica, r.steps, f"{r.step_ms:.2f}", *(f"{r.phase_ms[p]:.2f}" for p in PHASES),
             f"{100 * r.compute_share:.0f}%"] for r in rows]
    return "mean ms per step\n" + table(["rank", "stage", "replica", "steps", "step", *PHASES, "compute"], body)


def draw_gantt(merged: dict, path: Path, *, last_steps: int = 4) -> Path:
    """A Gantt picture: one row per rank, phases as coloured bars, p2p transfers as thin bars below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    window = step_window(merged, last_steps)
    ranks = [int(m["rank"]) for m in merged["otherData"]["hybridpipe"]["ranks"]]
    labels = {int(m["rank"]): f"rank {m['rank']}\nstage {','.join(map(str, m.get('stages') or [m['stage']]))} "
                              f"replica {m['replica']}"
              for m in merged["otherData"]["hybridpipe"]["ranks"]}
    row = {r: i for i, r in enumerate(ranks)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in merged["traceEvents"]:
        step = e.get("args", {}).get("step")
        if e.get("ph") != "X" or e.get("tid") not in (TID_PHASES, TID_TRANSFERS):
            continue
        if window and (step is None or not window[0] <= step <= window[1]):
            continue
        kind = e["name"] if e["tid"] == TID_PHASES else "transfer"
        bars.setdefault((e["pid"], kind), []).append((e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3)))
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(ranks)))
    for (pid, kind), spans in bars.items():
        y = len(ranks) - 1 - row[pid]
        if kind == "transfer":
            ax.broken_barh(spans, (y - 0.42, 0.12), facecolors="black", alpha=0.6)
        else:
            ax.broken_barh(spans, (y - 0.28, 0.64), facecolors=PHASE_COLOURS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [labels[r] for r in reversed(ranks)], fontsize=8)
    ax.set_xlabel("time (ms)")
    steps_text = f"steps {window[0]}-{window[1]}" if window else "no steps"
    ax.set_title(f"hybridpipe timeline: {len(ranks)} ranks, {steps_text}")
    handles = [Patch(color=PHASE_COLOURS[p], label=p) for p in PHASES]
    handles.append(Patch(color="black", alpha=0.6, label="p2p transfer"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
