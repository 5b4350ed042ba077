"""Pure helpers of ``benchmarks/plans.py``: scaling a profile, the busy-aware re-simulation,
naming and comparing plans, the rows of the report and its figure. Plain data in, plain data
out (tested without processes).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

STRATEGIES = ("optimal", "dp", "uniform", "params", "time", "pipedream")
LAYER_STRATEGIES = ("torchtitan", "megatron")   # transformers only (a layer stack); asked for with --strategies
STAGED = ("uniform", "params", "torchtitan", "megatron")   # take S@N: N stages of workers/N replicas (--stages N)


def strategy_args(strategy: str) -> list[str]:
    """``hybridpipe partition`` flags of a strategy name: ``S``, or ``S@N`` (a baseline S on N stages, each of
    workers / N replicas: hybrid layouts, e.g. ``uniform@2`` on 4 hosts is 2 stages x 2 replicas)."""
    base, at, stages = strategy.partition("@")
    if base not in STRATEGIES + LAYER_STRATEGIES or (at and (base not in STAGED or not stages.isdigit()
                                                             or int(stages) < 1)):
        raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES + LAYER_STRATEGIES)}, or "
                         f"S@N with S one of {', '.join(STAGED)} and N stages")
    return ["--strategy", base, *(["--stages", stages] if stages else [])]
ERROR_GOAL = 0.10          # |measured / predicted - 1| the benchmark aims at
MEMORY_MARGIN = 0.8          # a plan runs only if its predicted memory fits in this share of MemAvailable
PROCESS_OVERHEAD = 350 << 20  # bytes per worker process beyond the plan's estimate (torch, gloo, python)


def scale_profile(profile: Mapping[str, Any], factor: float, note: str, optimizer_factor: float | None = None) -> dict:
    """A copy of a profile JSON with every node's forward/backward time multiplied by ``factor``
    (its optimizer step times by ``optimizer_factor``, default ``factor``).

    The graph (and so the signature) is unchanged; the totals are rescaled to match and
    ``note`` is appended to the profile's notes, so the file says how it was calibrated.
    """
    if not factor > 0:
        raise ValueError(f"a compute scale factor must be positive, got {factor!r}")
    out = copy.deepcopy(dict(profile))
    for node in out["nodes"]:
        node["forward_ms"] = node.get("forward_ms", 0.0) * factor
        node["backward_ms"] = node.get("backward_ms", 0.0) * factor
    totals = out.get("totals") or {}
    for key in ("forward_ms", "backward_ms", "measured_ms"):
        if key in totals:
            totals[key] = totals[key] * factor
    for key in ("sgd_step_ms", "adam_step_ms"):
        if key in totals:
            totals[key] = totals[key] * (factor if optimizer_factor is None else optimizer_factor)
    out["notes"] = [*out.get("notes", []), note]
    return out


def compute_scale(node_sum_ms: float, alone_ms: float, contended_ms: float) -> dict[str, float]:
    """How the profile's per-node sum becomes the time one worker's compute takes on the emulated hosts.

    ``alone_ms``: a full forward+loss+backward, one process, one thread; ``contended_ms``: the
    same while every emulated host's copy runs at once. ``scale`` = contended / node sum is
    the product of ``isolation`` (alone / node sum: what timing nodes one by one misses or
    adds) and ``contention`` (contended / alone: the cores shared by the hosts).
    """
    if min(node_sum_ms, alone_ms, contended_ms) <= 0:
        raise ValueError("compute times must be positive")
    return {"isolation": alone_ms / node_sum_ms, "contention": contended_ms / alone_ms,
            "scale": contended_ms / node_sum_ms}


def contention_at(curve: Mapping[int, float], busy: float) -> float:
    """The measured contention factor (time with k copies at once / alone) at ``busy`` copies,
    linear between the measured copy counts, clamped to the measured range (c(1) = 1)."""
    points = sorted({1: 1.0, **{int(k): float(v) for k, v in curve.items()}}.items())
    if busy <= points[0][0]:
        return points[0][1]
    for (k0, c0), (k1, c1) in pairwise(points):
        if busy <= k1:
            return c0 + (c1 - c0) * (busy - k0) / (k1 - k0)
    return points[-1][1]


def scale_plan_compute(plan: Mapping[str, Any], ratio: float) -> dict:
    """A copy of a plan JSON with every stage's forward/backward/compute time multiplied by ``ratio``."""
    out = copy.deepcopy(dict(plan))
    for s in out["stages"]:
        for key in ("forward_ms", "backward_ms", "compute_ms"):
            s[key] = s.get(key, 0.0) * ratio
    return out


def compute_concurrency(intervals: Sequence[tuple[float, float]]) -> float:
    """How many workers compute at once, as a unit of compute work sees it on average.

    ``intervals``: (start, end) of every compute interval of every worker. With n(t) workers
    computing at time t, this is integral n(t)^2 dt / integral n(t) dt: data parallelism, whose
    replicas all compute together and then all communicate, gets N, not its time-average.
    """
    events = sorted([(t0, 1) for t0, t1 in intervals if t1 > t0] + [(t1, -1) for t0, t1 in intervals if t1 > t0])
    work = weighted = 0.0
    n, last = 0, None
    for t, d in events:
        if last is not None and n:
            work += n * (t - last)
            weighted += n * n * (t - last)
        n, last = n + d, t
    return weighted / work if work > 0 else 1.0


def busy_aware_prediction(plan: dict, curve: dict[int, float], hosts: int, calibrations: Sequence[Path],
                          iterations: int = 4) -> dict:
    """The plan's step re-simulated with the contention of the workers that compute at once.

    The plan's compute times assume all ``hosts`` workers compute at once (contention c(hosts)).
    In a pipeline some stages wait, so fewer compete for the cores: simulate the plan, take B =
    how many workers compute at once as the compute work sees it (compute_concurrency), rescale
    compute by c(B) / c(hosts) (c measured, interpolated), and repeat a few times. Communication
    is not counted as busy (gloo's copies and reductions do use the cores: see the report).
    """
    from hybridpipe.partitioner.cost.calibration import load_calibration
    from hybridpipe.partitioner.cost.costmodel import CostModel
    from hybridpipe.partitioner.plan import Plan
    from hybridpipe.pipeline.simulator import simulate
    base = Plan.from_dict(plan)
    model = CostModel(base.cluster, load_calibration(calibrations[0]) if calibrations else None)
    full = contention_at(curve, hosts)
    def concurrency(result) -> float:
        return compute_concurrency([(iv.t0, iv.t1) for iv in result.intervals if iv.kind in ("F", "B")])

    first = simulate(base, cost_model=model)
    busy, result = concurrency(first), first
    for _ in range(iterations):
        ratio = contention_at(curve, busy) / full
        result = simulate(Plan.from_dict(scale_plan_compute(plan, ratio)), cost_model=model)
        busy = concurrency(result)
    return {"simulated_step_ms": first.step_ms, "busy_workers": round(busy, 2),
            "contention_busy": round(contention_at(curve, busy), 3), "contention_all": round(full, 3),
            "predicted_busy_step_ms": result.step_ms}


def stage_layout(plan: Mapping[str, Any]) -> str:
    """``"0-16x2 | 17x1 | 18-23x1"``: node range x replicas of each stage."""
    parts = []
    for s in plan["stages"]:
        nodes = f"{s['first_node']}" if s["first_node"] == s["last_node"] else f"{s['first_node']}-{s['last_node']}"
        parts.append(f"{nodes}x{s['replicas']}")
    return " | ".join(parts)


def plan_key(plan: Mapping[str, Any]) -> tuple:
    """What the runtime does with a plan: schedule, micro-batches, stages and every layer's algorithm.

    Two strategies whose plans have the same key train identically, so one run measures both.
    """
    return (plan["schedule"], plan["micro_batches"], plan["batch_size"],
            tuple((s["first_node"], s["last_node"], s["replicas"], tuple(s["ranks"]),
                   tuple(lv["algorithm"] for lv in s.get("layers", ()))) for s in plan["stages"]))


def allreduce_choices(plan: Mapping[str, Any]) -> list[dict[str, int]]:
    """Per stage, how many layers sync with each all-reduce algorithm (empty for 1 replica)."""
    return [dict(sorted(Counter(lv["algorithm"] for lv in s.get("layers", ())).items())) if s["replicas"] > 1 else {}
            for s in plan["stages"]]


def prediction_error(measured_ms: float | None, predicted_ms: float | None) -> float | None:
    """measured / predicted - 1 (positive: slower than predicted); None if either is missing."""
    if not measured_ms or not predicted_ms:
        return None
    return measured_ms / predicted_ms - 1.0


def add_relative(rows: list[dict]) -> list[dict]:
    """Give every row of a (model, hosts) group its throughput relative to that group's ``optimal``.

    ``measured_vs_optimal`` = samples/s / optimal's samples/s, likewise ``predicted_vs_optimal``;
    None where either side did not run.
    """
    base: dict[tuple, dict] = {(r["model"], r["hosts"]): r for r in rows if r["strategy"] == "optimal"}
    for r in rows:
        ref = base.get((r["model"], r["hosts"]))
        r["measured_vs_optimal"] = _ratio(r.get("samples_per_s"), ref and ref.get("samples_per_s"))
        r["predicted_vs_optimal"] = _ratio(r.get("predicted_samples_per_s"), ref and ref.get("predicted_samples_per_s"))
        r["predicted_busy_vs_optimal"] = _ratio(r.get("predicted_busy_samples_per_s"),
                                                ref and ref.get("predicted_busy_samples_per_s"))
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def error_summary(rows: Sequence[Mapping[str, Any]], goal: float = ERROR_GOAL, key: str = "error") -> dict[str, Any]:
    """How many measured runs were within ``goal`` of the prediction (``key``: the row's error), the median |error|."""
    errs = [abs(r[key]) for r in rows if r.get(key) is not None and not r.get("same_plan_as")]
    errs.sort()
    median = None
    if errs:
        mid = len(errs) // 2
        median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    return {"runs": len(errs), "within_goal": sum(e <= goal for e in errs), "goal": goal,
            "median_abs_error": median, "max_abs_error": errs[-1] if errs else None}


# ---- rows of the report ---------------------------------------------------------------------

def memory_refusal(plan: dict) -> str | None:
    """Why this plan is not run on this machine (all its workers share its memory), or None."""
    need = sum(s["memory_bytes"] * s["replicas"] for s in plan["stages"])
    need += PROCESS_OVERHEAD * sum(s["replicas"] for s in plan["stages"])
    avail = _mem_available()
    if avail and need > MEMORY_MARGIN * avail:
        return (f"not run: its {sum(s['replicas'] for s in plan['stages'])} workers need about {need / 2**30:.1f} GiB "
                f"together (plan estimate + {PROCESS_OVERHEAD >> 20} MiB per process) but this machine has "
                f"{avail / 2**30:.1f} GiB available; the emulated hosts share one machine's memory")
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refusal_lines(text: str) -> str:
    """The lines of a failure that say why (UserError / Error lines), else its tail."""
    keep = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln or "refus" in ln]
    return "\n".join(keep[-6:]) if keep else text[-1500:]


def row_from(model: str, hosts: int, strategy: str, plan: dict, summary: dict | None, busy: dict | None = None) -> dict:
    """One report row: the plan's prediction (and ``busy``: busy_aware_prediction()), its layout,
    what the run measured."""
    row = {"model": model, "hosts": hosts, "strategy": strategy, "layout": stage_layout(plan),
           "stages": len(plan["stages"]), "schedule": plan["schedule"], "micro_batches": plan["micro_batches"],
           "batch_size": plan["batch_size"], "global_batch": plan["batch_size"] * plan["micro_batches"],
           "predicted_step_ms": plan["predicted_step_ms"], "predicted_samples_per_s": plan["predicted_samples_per_s"],
           "allreduce_per_stage": allreduce_choices(plan),
           "predicted_memory_gib_per_stage": [round(s["memory_bytes"] / 2**30, 3) for s in plan["stages"]],
           **(busy or {})}
    if busy:
        row["predicted_busy_samples_per_s"] = row["global_batch"] / busy["predicted_busy_step_ms"] * 1e3
    if summary is None:
        return row
    if "failed" in summary or "not_run" in summary:
        row["status"] = "failed" if "failed" in summary else "not run"
        row["reason"] = summary.get("failed") or summary.get("not_run")
        return row
    row.update(status="ok", measured_step_ms=summary["measured_step_ms"], samples_per_s=summary["samples_per_s"],
               error=prediction_error(summary["measured_step_ms"], plan["predicted_step_ms"]),
               error_busy=prediction_error(summary["measured_step_ms"], row.get("predicted_busy_step_ms")),
               job_step_ms=[round(v, 1) for v in summary["job_step_ms"].values()], warmup_steps=summary["warmup_steps"],
               replicas_identical=summary["replicas_identical"], run_wall_s=round(summary["wall_s"], 1))
    return row


# ---- the figure ------------------------------------------------------------------------------

def plot(plt, rows: Sequence[Mapping[str, Any]], title: str):
    """Left: measured throughput relative to optimal per model x hosts, one bar per strategy
    (predicted ratio as a black tick). Right: predicted vs measured step time."""
    groups = list(dict.fromkeys((r["model"], r["hosts"]) for r in rows))
    named = (*STRATEGIES, *LAYER_STRATEGIES)
    strategies = [s for s in dict.fromkeys((*named, *(r["strategy"] for r in rows if r["strategy"] not in named),
                                            "autotune")) if any(r["strategy"] == s for r in rows)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    w = 0.8 / max(1, len(strategies))
    for k, strategy in enumerate(strategies):
        xs, meas, pred, busy = [], [], [], []
        for i, g in enumerate(groups):
            r = next((r for r in rows if (r["model"], r["hosts"]) == g and r["strategy"] == strategy), None)
            if r is None:
                continue
            x = i + (k - (len(strategies) - 1) / 2) * w
            if r.get("measured_vs_optimal") is None:
                ax.text(x, 0.02, "x", ha="center", va="bottom", color="red", fontsize=9)
                continue
            xs.append(x)
            meas.append(r["measured_vs_optimal"])
            pred.append(r.get("predicted_vs_optimal"))
            busy.append(r.get("predicted_busy_vs_optimal"))
        ax.bar(xs, meas, w, label=strategy)
        for ys, colour in ((pred, "k"), (busy, "m")):
            ax.scatter([x for x, y in zip(xs, ys, strict=True) if y], [y for y in ys if y], marker="_", s=120,
                       color=colour, zorder=3)
    ax.scatter([], [], marker="_", s=120, color="k", label="predicted ratio (plan)")
    ax.scatter([], [], marker="_", s=120, color="m", label="predicted ratio (busy-aware)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(groups)), [f"{m}\n{h} hosts" for m, h in groups], fontsize=8)
    ax.set_ylabel("throughput / optimal's (measured)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.set_title("x: plan not run (see JSON)", fontsize=8, loc="right", color="red")
    models = list(dict.fromkeys(r["model"] for r in rows))
    pts = [r for r in rows if r.get("measured_step_ms") and r.get("predicted_step_ms") and not r.get("same_plan_as")]
    for model in models:
        for hosts, marker in ((4, "o"), (8, "s")):
            sel = [r for r in pts if r["model"] == model and r["hosts"] == hosts]
            if sel:
                dots = ax2.scatter([r.get("predicted_busy_step_ms", r["predicted_step_ms"]) / 1e3 for r in sel],
                                   [r["measured_step_ms"] / 1e3 for r in sel], marker=marker,
                                   label=f"{model}, {hosts} hosts")
                ax2.scatter([r["predicted_step_ms"] / 1e3 for r in sel], [r["measured_step_ms"] / 1e3 for r in sel],
                            marker=marker, facecolors="none", edgecolors=dots.get_facecolor(), alpha=0.6)
    if pts:
        vals = [v for r in pts for v in (r["predicted_step_ms"], r["measured_step_ms"], r.get("predicted_busy_step_ms"))
                if v]
        lo, hi = min(vals) / 1e3 * 0.8, max(vals) / 1e3 * 1.2
        ax2.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = predicted")
        ax2.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2,
                         label="within 10%")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        from matplotlib.ticker import LogLocator, ScalarFormatter
        for axis in (ax2.xaxis, ax2.yaxis):
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(ScalarFormatter())
            axis.set_minor_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
    ax2.set_xlabel("predicted step (s); without CPU quotas: filled busy-aware, hollow the plan's")
    ax2.set_ylabel("measured step (s, median)")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig
