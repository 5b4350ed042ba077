"""The end-of-run summary: what every rank measured, combined (pure functions over plain data).

Each rank hands a :class:`RankReport` to one gather; :func:`summarize` turns them into the
``summary.json`` of the run and :func:`format_summary` into the lines printed at the end.

* Step time of the job at step k = the slowest rank's step k (a flushed pipeline step ends
  when its last rank is done). The measured step time is the median over the steps after a
  warm-up (the first fifth of the steps, at least one when more than one step ran), next to
  the plan's ``predicted_step_ms``.
* Loss of step k = the mean of the step's micro-batch losses, gathered from every replica of
  the last stage: the mean loss of the global batch, as single-process training reports it
  (``--loss-normalization tokens``: weighted by the micro-batches' valid tokens, i.e. the global
  batch's summed loss over its tokens; ``loss_normalization`` says which).
* Replicas of a stage must hold bitwise identical weights and buffers at the end (two digests per
  rank); the buffers their running statistics were combined into (pipeline/batch_stats.py) are named.
* Gradient sync: per replicated stage, each of the plan's layers with the algorithm its
  all-reduce actually ran (as the stage's HybridDataParallel recorded it on its first replica)
  and the plan's (``runtime/sync.py``); ``sync_as_planned`` says whether they all agree.
* Settings: ``training`` holds the run's TrainingConfig (runtime/training_config.py), every field.
* Threads: the intra-op CPU threads the ranks computed with, next to the profile's (the plan's
  ``profile_threads``): the plan's times are that setting's, so a difference is named at the end.
* Memory: per rank the peak bytes its stage held in any step (``pipeline/memory.py``: CUDA's max
  allocated, or on the CPU the tensors it holds), next to the plan's ``memory_bytes`` prediction
  (on the CPU less the kernels' ``transient_bytes``, which only an allocator sees).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from hybridpipe.partitioner.plan import Plan
from hybridpipe.runtime.metrics import weighted_mean
from hybridpipe.runtime.training_config import TrainingConfig


@dataclass
class RankReport:
    """What one rank measured in this session (steps numbered over the whole run)."""

    rank: int
    stage: int
    replica: int
    step_ms: dict[int, float] = field(default_factory=dict)
    losses: dict[int, dict[int, float]] = field(default_factory=dict)   # step -> micro-batch -> loss
    tokens: dict[int, dict[int, float]] = field(default_factory=dict)   # the same micro-batches' valid tokens
    digest: str | None = None                                             # weights, replicated stages only
    buffers: str | None = None                                            # buffers' digest, likewise
    combined: dict[int, list[str]] = field(default_factory=dict)  # stage -> buffers combined across replicas
    sync: list[dict] | None = None       # replicated stages: per layer {"layer", "algorithm", "planned"}
    peak_memory_bytes: int = 0           # the most the rank's stage held in any step (pipeline/memory.py)
    allocator_peak: bool = False         # that is the allocator's peak (CUDA: kernels' temporaries too), not
    #                                      the tensors the stage holds (CPU)
    more_stages: tuple[int, ...] = ()    # virtual stages: the rank's other model chunks (``stage`` is the first)
    more_sync: dict[int, list[dict]] = field(default_factory=dict)    # ``sync`` of those chunks, by stage
    threads: int = 0                     # intra-op CPU threads it computed with (0: a GPU rank)

    @property
    def stages(self) -> tuple[int, ...]:
        """Every stage (model chunk) the rank ran."""
        return (self.stage, *self.more_stages)


def warmup_steps(n: int) -> int:
    """Steps left out of the measured step time: the first fifth, at least one if n > 1."""
    return min(max(1, n // 5), n - 1) if n > 1 else 0


def step_losses(reports: list[RankReport], micro_batches: int) -> dict[int, float]:
    """Mean loss per step over all its micro-batches, weighted by their tokens where the reports
    carry them (steps missing a micro-batch are left out)."""
    merged: dict[int, dict[int, float]] = {}
    tokens: dict[int, dict[int, float]] = {}
    for r in reports:
        for step, per_mb in r.losses.items():
            merged.setdefault(step, {}).update(per_mb)
        for step, per_mb in r.tokens.items():
            tokens.setdefault(step, {}).update(per_mb)
    out = {}
    for k, v in sorted(merged.items()):
        if len(v) == micro_batches:
            w = tokens.get(k)
            out[k] = weighted_mean([v[m] for m in sorted(v)], [w[m] for m in sorted(v)] if w else None)
    return out


def sync_summary(reports: list[RankReport]) -> tuple[dict[str, list[dict]], bool | None]:
    """Per replicated stage (first replica's record), each layer and the algorithm that ran; and
    whether every layer ran what the plan says (None without replicated stages; False where the
    plan lists no layers for a replicated stage)."""
    sync = {str(r.stage): r.sync for r in sorted(reports, key=lambda r: (r.stage, r.replica))
            if r.sync is not None and r.replica == 0}
    sync.update({str(s): layers for r in reports if r.replica == 0 for s, layers in r.more_sync.items()})
    sync = dict(sorted(sync.items(), key=lambda kv: int(kv[0])))
    entries = [e for layers in sync.values() for e in layers]
    if not sync:
        return {}, None
    return sync, all(e["planned"] is not None and e["algorithm"] == e["planned"] for e in entries)


def summarize(reports: list[RankReport], plan: Plan, *, steps: int, first_step: int, run_dir: str,
              trace_dir: str | None, schedule: str, config: TrainingConfig | None = None,
              skipped: list[int] | None = None) -> dict:
    """The run's summary (what ``summary.json`` holds); ``config``: the run's settings (default: the defaults)."""
    config = config or TrainingConfig()
    reports = sorted(reports, key=lambda r: r.rank)
    ran = sorted(set().union(*(r.step_ms for r in reports)))
    job_ms = {k: max(r.step_ms[k] for r in reports if k in r.step_ms) for k in ran}
    skip = warmup_steps(len(ran))
    steady = [job_ms[k] for k in ran[skip:]]
    measured = statistics.median(steady) if steady else None
    global_batch = plan.batch_size * plan.micro_batches
    predicted = plan.predicted_step_ms or None
    replicas, differ = {}, {}
    for s in plan.stages:
        if s.replicas > 1:
            mine = [r for r in reports if s.index in r.stages]
            what = [kind for kind, digests in (("weights", {r.digest for r in mine}),
                                               ("buffers", {r.buffers for r in mine}))
                    if len(digests) != 1 or None in digests]
            replicas[str(s.index)] = not what
            if what:
                differ[str(s.index)] = " and ".join(what)
    combined = {str(k): v for r in sorted(reports, key=lambda r: r.rank) if r.replica == 0
                for k, v in sorted(r.combined.items())}
    sync, as_planned = sync_summary(reports)
    return {
        "model": plan.model, "schedule": schedule, "comm_mode": config.comm_mode,
        "allreduce": config.allreduce or "as planned", "precision": config.precision or plan.precision,
        "reduce_dtype": config.reduce_dtype, "training": dataclasses.asdict(config),
        "micro_batches": plan.micro_batches, "batch_size": plan.batch_size, "global_batch": global_batch,
        "world_size": plan.world_size, "stages": [[s.first_node, s.last_node, s.replicas] for s in plan.stages],
        "steps": steps, "first_step": first_step, "steps_run": len(ran), "warmup_steps": skip,
        "measured_step_ms": measured, "predicted_step_ms": predicted,
        "measured_over_predicted": measured / predicted if measured and predicted else None,
        "samples_per_s": global_batch / measured * 1e3 if measured else None,
        "predicted_samples_per_s": plan.predicted_samples_per_s or None,
        "job_step_ms": {str(k): v for k, v in job_ms.items()},
        "loss": {str(k): v for k, v in step_losses(reports, plan.micro_batches).items()},
        "loss_normalization": plan.loss_normalization,
        "replicas_identical": replicas, "replicas_differ": differ, "buffers_combined": combined,
        "skipped_nonfinite_steps": sorted(skipped or []),
        "sync": sync, "sync_as_planned": as_planned,
        "memory": [memory_record(r, plan) for r in reports],
        "threads": {"profile": plan.profile_threads, "ranks": sorted({r.threads for r in reports if r.threads})},
        "run_dir": run_dir, "metrics_dir": f"{run_dir}/metrics", "trace_dir": trace_dir,
    }


def sync_line(sync: dict[str, list[dict]], as_planned: bool | None, shown: int = 4) -> str:
    """The summary's gradient-sync line: as planned, or which layers ran something else."""
    entries = [(k, e) for k, layers in sync.items() for e in layers]
    counts: dict[str, int] = {}
    for _, e in entries:
        counts[str(e["algorithm"])] = counts.get(str(e["algorithm"]), 0) + 1
    ran = ", ".join(f"{n} {a}" for a, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))
    if as_planned:
        return f"  all-reduce: as the plan says ({len(entries)} layers in {len(sync)} replicated stage(s): {ran})"
    other = [f"stage {k} {e['layer']} {e['algorithm']} (plan: {e['planned'] or 'none'})" for k, e in entries
             if e["algorithm"] != e["planned"]]
    more = f" and {len(other) - shown} more" if len(other) > shown else ""
    return f"  all-reduce: NOT as the plan says: {', '.join(other[:shown])}{more}"


def replicas_line(identical: dict[str, bool], differ: dict[str, str], combined: dict[str, list[str]],
                  shown: int = 3) -> str:
    """The summary's replicas line: identical weights and buffers (and which running statistics
    were combined across replicas), or what differs where."""
    diverged = [k for k, same in identical.items() if not same]
    if diverged:
        return "  replicas: " + "; ".join(f"{differ.get(k, 'weights').upper()} DIFFER between the replicas of "
                                          f"stage {k}" for k in diverged)
    line = "  replicas: identical weights and buffers in every replicated stage"
    if combined:
        parts = []
        for k, names in combined.items():
            owners = list(dict.fromkeys(n.rpartition(".")[0] or n for n in names))
            more = f" and {len(owners) - shown} more" if len(owners) > shown else ""
            parts.append(f"stage {k}: {', '.join(owners[:shown])}{more}")
        line += f" (running statistics combined across replicas: {'; '.join(parts)})"
    return line


def loss_rows(losses: dict[str, float], rows: int = 6) -> list[tuple[int, float]]:
    """Up to ``rows`` (step, loss) pairs spread evenly over the run, first and last included."""
    items = sorted((int(k), v) for k, v in losses.items())
    if len(items) <= rows:
        return items
    picks = sorted({round(i * (len(items) - 1) / (rows - 1)) for i in range(rows)})
    return [items[i] for i in picks]


def memory_record(report: RankReport, plan: Plan) -> dict:
    """A rank's peak against the plan's prediction for it, like for like: the allocator's peak (CUDA)
    against the whole prediction; the tensors held (the CPU meter) against it less the kernels'
    transient bytes, which only an allocator sees (reported beside it)."""
    # per worker: with virtual stages every chunk of a rank carries the worker's total
    predicted = max(plan.stages[s].memory_bytes for s in report.stages)
    transient = 0 if report.allocator_peak else max(plan.stages[s].transient_bytes for s in report.stages)
    return {"rank": report.rank, "stage": report.stage, "peak_bytes": report.peak_memory_bytes,
            "counts": "allocator" if report.allocator_peak else "tensors held",
            "predicted_bytes": predicted - transient, "transient_bytes_not_counted": transient}


def memory_line(memory: list[dict]) -> str:
    """The peak memory of the hungriest rank, against the plan's prediction for its stage."""
    top = max(memory, key=lambda m: m["peak_bytes"])
    line = f"  memory: peak {top['peak_bytes'] / 2**20:.1f} MiB on rank {top['rank']} (stage {top['stage']})"
    if top["predicted_bytes"]:
        line += f", plan predicted {top['predicted_bytes'] / 2**20:.1f} MiB"
        if top.get("transient_bytes_not_counted"):
            line += (f" held (+{top['transient_bytes_not_counted'] / 2**20:.1f} MiB of kernels' temporaries, "
                     "which the CPU's tensor count does not see)")
    return line


def threads_note(threads: dict | None) -> str | None:
    """What to do when the ranks computed with other intra-op thread counts than the profile measured
    with (``summary["threads"]``), or None."""
    if not threads or not threads["profile"] or not threads["ranks"] or threads["ranks"] == [threads["profile"]]:
        return None
    ran = "/".join(map(str, threads["ranks"]))
    return (f"the ranks computed with {ran} intra-op CPU thread(s), the profile measured with {threads['profile']}: "
            f"the plan priced another setting (profile with --threads {threads['ranks'][0]} for this one)")


def _precision(s: dict) -> str:
    """", bf16 (gradients reduced in fp32)" on the summary's first line; nothing for fp32 throughout."""
    precision, reduce = s.get("precision", "fp32"), s.get("reduce_dtype", "fp32")
    if precision == reduce == "fp32":
        return ""
    return f", {precision} (replicas' gradients summed in {reduce})"


def format_summary(summary: dict) -> str:
    """The lines printed at the end of a run."""
    s = summary
    out = [f"hybridpipe: {s['steps_run']} steps of {s['model']} ({s['schedule']}, global batch {s['global_batch']} = "
           f"{s['micro_batches']} micro-batches x {s['batch_size']} samples, {s['world_size']} workers, "
           f"p2p {s['comm_mode']}, all-reduce {s['allreduce']}{_precision(s)})"]
    rows = loss_rows(s["loss"])
    if rows:
        tokens = s.get("loss_normalization") == "tokens"
        per = "over the global batch's tokens" if tokens else "mean of micro-batch means"
        out.append("  loss: " + ", ".join(f"step {k}: {v:.4f}" for k, v in rows) + f" ({per})")
    if s["measured_step_ms"] is not None:
        line = (f"  step time: measured {s['measured_step_ms']:.1f} ms (median after {s['warmup_steps']} "
                f"warm-up steps, {s['samples_per_s']:.1f} samples/s)")
        if s["predicted_step_ms"]:
            line += (f", plan predicted {s['predicted_step_ms']:.1f} ms "
                     f"(measured/predicted {s['measured_over_predicted']:.2f})")
        out.append(line)
        if threads_note(s.get("threads")):
            out.append(f"  note: {threads_note(s.get('threads'))}")
    if s["replicas_identical"]:
        out.append(replicas_line(s["replicas_identical"], s.get("replicas_differ", {}), s.get("buffers_combined", {})))
    if s.get("sync"):
        out.append(sync_line(s["sync"], s["sync_as_planned"]))
    if s.get("memory"):
        out.append(memory_line(s["memory"]))
    skipped = s.get("skipped_nonfinite_steps") or []
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        out.append(f"  skipped {len(skipped)} step(s) whose loss was not finite (no weights changed): {shown}")
    out.append(f"  metrics: {s['metrics_dir']}/   summary: {s['run_dir']}/summary.json")
    if s["trace_dir"]:
        out.append(f"  timeline: {s['trace_dir']}/ (merge: `hybridpipe timeline {s['trace_dir']} --png timeline.png`)")
    return "\n".join(out)
