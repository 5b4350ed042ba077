"""One worker process: join the job, build this rank's part of the pipeline, train, report.

    cfg = resolve(build_parser().parse_args(argv), env_world_size())
    summary = run_worker(cfg)          # every rank; the summary on the reporting rank, else None

The training itself runs through the Python API (runtime/trainer.py). The order of collective
calls is the same on every rank: the run directory (broadcast), the
replica groups, the HybridDataParallel broadcast of a replicated stage's initial weights (its
group only), the p2p channels, the timeline's clock alignment, the checkpoint restore, the
steps, the final checkpoint and the summary gather. Any failure inside is handed to the
operations engineer's FailureGuard, which names the rank that failed first and exits.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpipe.errors import UserError, one_line
from hybridpipe.jsonfile import write_json
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline import MicroBatches
from hybridpipe.profiles.capture import tied_parameters
from hybridpipe.runtime.config import RunConfig
from hybridpipe.runtime.dirlock import DirLock, Holder
from hybridpipe.runtime.failure import EXIT_PEER_LOST, FailureGuard, default_store, describe_ranks
from hybridpipe.runtime.groups import Process, init_distributed
from hybridpipe.runtime.lr import lr_schedule
from hybridpipe.runtime.metrics import MetricsWriter, Progress, step_record
from hybridpipe.runtime.parts import Model, buffers_digest, load_model, make_data, make_eval_data, weights_digest
from hybridpipe.runtime.reshard import canonical_names, indexed_optimizer_state, optimizer_names
from hybridpipe.runtime.restarts import (
    append_log,
    first_step_done,
    note_exit,
    process_start_time,
    read_log,
    read_notes,
    restart_entry,
)
from hybridpipe.runtime.summary import RankReport, format_summary, summarize
from hybridpipe.runtime.sync import sync_report
from hybridpipe.runtime.timeline import TimelineRecorder, trace_dir
from hybridpipe.runtime.trainer import Trainer

log = logging.getLogger(__name__)


def run_worker(cfg: RunConfig, *, print_fn: Callable[[str], None] = print) -> dict | None:
    """Train ``cfg`` on this process's rank (see the module docstring); returns the summary on the
    reporting rank (the last stage's first replica), None elsewhere. Joins the job torchrun
    started, or uses the default process group when the caller already made one."""
    entered = time.time()
    model = load_model(cfg)                    # before any process group: a wrong plan fails alone
    init_optimizer = model.start_from(cfg.init_from) if cfg.init_from else None
    captured = time.time()
    proc, owned = init_distributed(cfg.backend, cfg.timeout)
    lock = None
    try:
        if proc.world_size != cfg.plan.world_size:
            raise UserError(f"the plan needs {cfg.plan.world_size} workers but the job has {proc.world_size}")
        lock = _lock_checkpoint_dir(cfg, proc.rank)     # before anything is written there
        closers: list[Callable[[], object]] = []
        # steps completed (for the exit note) and when this worker got how far (the restart record)
        progress = {"done": 0, "entered": entered, "captured": captured}
        guard = FailureGuard(default_store(), rank=proc.rank, world_size=proc.world_size,
                             timeout=min(cfg.peer_timeout, cfg.timeout), program="hybridpipe.launch",
                             describe=describe_ranks(cfg.plan), on_exit=[lambda: _close_all(closers)],
                             hint="restart with --resume to continue from the newest checkpoint"
                             if cfg.checkpoint_dir else "")
        if cfg.checkpoint_dir:              # a peer died: leave a note for the restart (restarts.py)
            root = cfg.checkpoint_dir

            def leave_note() -> None:
                if guard.exit_code == EXIT_PEER_LOST:
                    note_exit(root, proc.rank, proc.world_size, int(progress["done"]))
            guard.on_exit.append(leave_note)
        if lock is not None:
            guard.on_exit.append(lock.release)
        with guard:
            summary = _train(cfg, proc, model, closers, print_fn, init_optimizer, progress, guard.critical)
    finally:
        if lock is not None:
            lock.release()
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def _lock_checkpoint_dir(cfg: RunConfig, rank: int) -> DirLock | None:
    """Rank 0 locks ``--checkpoint-dir`` for the job's life (runtime/dirlock.py); every rank learns
    the outcome (collective): UserError on every rank when another job has it, nothing written."""
    if not cfg.checkpoint_dir:
        return None
    lock, said = None, [None, ""]
    if rank == 0:
        try:
            lock, note = DirLock.acquire(cfg.checkpoint_dir, Holder.here())
            said = [None, note]
        except UserError as e:
            said = [one_line(e), ""]
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    if said[0] is not None:
        raise UserError(str(said[0]))
    if said[1] and rank == 0:
        print(f"hybridpipe: {said[1]}", file=sys.stderr, flush=True)
    return lock


def _train(cfg: RunConfig, proc: Process, model: Model, closers: list, print_fn, init_optimizer: dict | None,
           progress: dict, critical: AbstractContextManager) -> dict | None:
    """launch's loop around the Python API (runtime/trainer.py): metrics, progress bar, timeline,
    checkpoints every K steps (each inside ``critical``: a stop signal lets it finish), the summary."""
    plan, rank = cfg.plan, proc.rank
    stage_plans, replica = plan.stages_of_rank(rank)      # one, or the rank's model chunks (virtual stages)
    stage_plan = stage_plans[0]
    reporter = rank == plan.stages[-1].ranks[0]
    run_dir = _agree_run_dir(cfg, rank)
    if cfg.planned_s is not None and rank == 0:
        save_plan(plan, run_dir / "plan.json")
        print_fn(f"hybridpipe: planned {len(plan.stages)} stage(s) x replicas "
                 f"{[s.replicas for s in plan.stages]} for {plan.world_size} workers in {cfg.planned_s:.2f} s; "
                 f"wrote {run_dir / 'plan.json'}")
    traces = None if cfg.trace_dir == "" else Path(cfg.trace_dir or trace_dir(run_dir))
    recorder = None
    if traces is not None:
        recorder = TimelineRecorder(traces, rank=rank, stage=stage_plan.index, replica=replica,
                                    world_size=proc.world_size, label=f"{plan.model} {cfg.schedule}",
                                    stages=[s.index for s in stage_plans])
        closers.append(recorder.close)
    hint = f"the newest checkpoint in {cfg.checkpoint_dir} is the last good one" if cfg.checkpoint_dir else ""
    trainer = Trainer(model, plan, optimizer=cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
                      weight_decay=cfg.weight_decay, clip_grad_norm=cfg.clip_grad_norm, seed=cfg.seed,
                      lr_scheduler=lr_schedule(cfg.lr_schedule, warmup=cfg.warmup_steps, total=cfg.steps),
                      data=make_data(cfg, model.spec), comm_mode=cfg.comm_mode, allreduce=cfg.allreduce,
                      calibrations=cfg.calibrations, aggregator=cfg.aggregator, skip_nonfinite=cfg.skip_nonfinite,
                      timeout=cfg.timeout, precision=cfg.precision, recorder=recorder, nonfinite_hint=hint,
                      reduce_dtype=cfg.reduce_dtype, loss_normalization=cfg.loss_normalization)
    held_out = make_eval_data(cfg, model.spec) if cfg.eval_every else None
    start, restart = 0, None
    if init_optimizer is not None:
        canon = canonical_names(tied_parameters(model.module))
        names = optimizer_names(trainer.optimizer, trainer.module, canon)
        trainer.optimizer.load_state_dict(indexed_optimizer_state(init_optimizer, names,
                                                                  trainer.optimizer.state_dict()))
    if cfg.checkpoint_dir and cfg.resume:
        t_load = time.perf_counter()
        start = _restore(trainer, cfg.checkpoint_dir, print_fn if rank == plan.stages[0].ranks[0] else None)
        if reporter:
            restart = restart_entry(read_notes(Path(cfg.checkpoint_dir)), world_size=proc.world_size,
                                    resumed_from=start, started=process_start_time(),
                                    planning_s=cfg.planned_s or 0.0, load_s=time.perf_counter() - t_load, stages={
                                        "imports_s": progress["entered"], "model_s": progress["captured"],
                                        "job_s": time.time() - (time.perf_counter() - t_load)})
    progress["done"] = start

    metrics = MetricsWriter(run_dir, rank)
    closers.append(metrics.close)
    report = RankReport(rank, stage_plan.index, replica, more_stages=tuple(s.index for s in stage_plans[1:]))
    bar = Progress(cfg.steps, initial=start, enabled=cfg.progress and reporter,
                   desc=f"{plan.model} {cfg.schedule}")
    saved_at = start
    if held_out is not None and start < cfg.steps:        # the held-out loss before training
        metrics.write({"step": start - 1, "eval_loss": _evaluate(trainer, held_out, cfg.eval_batches)})
    try:
        for step in range(start, cfg.steps):
            if recorder is not None:
                recorder.begin_step(step)
            t0 = time.perf_counter()
            lr = trainer.lr
            evaluate = cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1)
            due = bool(cfg.checkpoint_dir) and cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0
            # every rank: stops on a non-finite loss; pipedream drains before an evaluation or a checkpoint
            trainer.train_step(drain=step == cfg.steps - 1 or evaluate or due)
            if proc.device.type == "cuda":
                torch.cuda.synchronize(proc.device)
            seconds = time.perf_counter() - t0
            if recorder is not None:
                recorder.end_step()
            losses, tokens = trainer.last_losses, trainer.last_tokens
            record = step_record(step, seconds, cfg.global_batch, list(losses.values()), trainer.last_peak_memory_bytes,
                                 weights=list(tokens.values()) if tokens else None)
            report.peak_memory_bytes = max(report.peak_memory_bytes, trainer.last_peak_memory_bytes)
            if lr is not None:
                record["lr"] = lr
            if trainer.last_grad_norm is not None:
                record["grad_norm"] = round(trainer.last_grad_norm, 6)
            if trainer.scaler is not None:
                record["loss_scale"] = trainer.scaler.scale
            if evaluate:
                record["eval_loss"] = _evaluate(trainer, held_out, cfg.eval_batches)
            metrics.write(record)
            bar.update(record)
            report.step_ms[step] = record["step_ms"]
            if losses:
                report.losses[step] = losses
            if tokens:
                report.tokens[step] = tokens
            progress["done"] = step + 1
            if restart is not None and cfg.checkpoint_dir:
                append_log(Path(cfg.checkpoint_dir), first_step_done(restart, seconds))
                restart = None
            if due and cfg.checkpoint_dir:
                with critical:
                    trainer.save(cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
                saved_at = step + 1
    finally:
        bar.close()
    if cfg.checkpoint_dir and saved_at < cfg.steps:          # the final weights, always
        with critical:
            trainer.save(cfg.checkpoint_dir, keep=cfg.keep_checkpoints)

    trainer.close()
    _close_all(closers)
    if stage_plan.replicas > 1:
        report.digest = weights_digest(trainer.module)
        report.buffers = buffers_digest(trainer.module)
        report.combined = {st.index: st.stats.buffers for st in trainer.stages if st.stats and st.stats.combines}
        report.sync = sync_report(trainer.syncs[stage_plan.index], stage_plan)
        report.more_sync = {s.index: ran for s in stage_plans[1:]
                            if (ran := sync_report(trainer.syncs[s.index], s)) is not None}
    reports: list = [None] * proc.world_size
    dist.all_gather_object(reports, report)
    if not reporter:
        return None
    summary = summarize(reports, plan, steps=cfg.steps, first_step=start, run_dir=str(run_dir),
                        trace_dir=str(traces) if traces is not None else None, schedule=cfg.schedule,
                        comm_mode=cfg.comm_mode, allreduce=cfg.allreduce, skipped=trainer.watch.skipped,
                        precision=cfg.precision, reduce_dtype=cfg.reduce_dtype)
    if cfg.checkpoint_dir:
        summary["restarts"] = read_log(Path(cfg.checkpoint_dir))
    write_json(Path(run_dir) / "summary.json", summary)
    print_fn(format_summary(summary))
    return summary


def _evaluate(trainer: Trainer, held_out: MicroBatches | None, batches: int) -> float:
    """The mean loss of ``batches`` held-out global batches (forward only, every rank)."""
    if held_out is None:
        raise RuntimeError("evaluation without held-out data")
    M = held_out.micro_batches
    losses = []
    for j in range(batches):
        parts = [held_out.batch(j, m) if held_out.targets else held_out.input(j, m) for m in range(M)]
        losses.append(trainer.eval_step(iter(parts)))
    return sum(losses) / len(losses)


def _restore(trainer: Trainer, directory: str, say: Callable[[str], None] | None) -> int:
    """Load the newest usable checkpoint (or stop: see Checkpointer.restore); ``say`` (one rank's
    print) tells the user where the run continues from."""
    restored = trainer.load(directory)
    if restored is None:
        if say is not None:
            say(f"hybridpipe: --resume: no checkpoint in {directory} yet; starting from step 0")
        return 0
    if say is not None:
        skipped = f" (skipped: {'; '.join(restored.skipped)})" if restored.skipped else ""
        moved = (f"; resharded from the plan that wrote it ({restored.resharded}); each rank's RNG re-seeded from "
                 "(--seed, rank, step)") if restored.resharded else ""
        say(f"hybridpipe: --resume: continuing from {restored.path} (step {restored.step}){skipped}{moved}")
    return restored.step


def _agree_run_dir(cfg: RunConfig, rank: int) -> Path:
    """Rank 0 names the run directory (runs/<time> by default) and tells everyone."""
    chosen = [""]                           # every rank gets rank 0's by the broadcast
    if rank == 0:
        chosen[0] = cfg.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    dist.broadcast_object_list(chosen, src=0)
    run_dir = Path(str(chosen[0]))
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0 and cfg.run_dir is None:
        _point_latest(run_dir)
    return run_dir


def _point_latest(run_dir: Path) -> None:
    """runs/latest -> the newest run (replaced atomically)."""
    latest = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, latest)
    except OSError as e:
        log.warning("could not point %s at %s: %s", latest, run_dir, e)


def _close_all(closers: list[Callable[[], object]]) -> None:
    while closers:
        closers.pop()()
