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
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import write_json
from hybridpipe.partitioner.plan import Stage, save_plan
from hybridpipe.pipeline import MicroBatches
from hybridpipe.profiles.capture import tied_parameters
from hybridpipe.runtime.agents import release_exit_barrier
from hybridpipe.runtime.config import RunConfig
from hybridpipe.runtime.dirlock import DirLock, lock_for_job
from hybridpipe.runtime.failure import EXIT_PEER_LOST, FailureGuard, default_store, describe_ranks, suspect_of
from hybridpipe.runtime.groups import Process, init_distributed
from hybridpipe.runtime.lr import lr_schedule
from hybridpipe.runtime.metrics import MetricsWriter, Progress, step_record
from hybridpipe.runtime.parts import Model, buffers_digest, load_model, make_data, make_eval_data, weights_digest
from hybridpipe.runtime.recovery import recoverer, renamed_report, train_step_recovering
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


def run_worker(cfg: RunConfig, *, print_fn: Callable[[str], None] = print,
               milestones: dict[str, float] | None = None) -> dict | None:
    """Train ``cfg`` on this process's rank (see the module docstring); returns the summary on the
    reporting rank (the last stage's first replica), None elsewhere. Joins the job torchrun started,
    or uses the default process group. ``milestones``: launch's times before (the restart record)."""
    entered = time.time()
    model = load_model(cfg)                    # before any process group: a wrong plan fails alone
    init_optimizer = model.start_from(cfg.init_from) if cfg.init_from else None
    captured = time.time()
    proc, owned = init_distributed(cfg.training.backend, cfg.training.timeout)
    lock = None
    try:
        if proc.world_size != cfg.plan.world_size:
            raise UserError(f"the plan needs {cfg.plan.world_size} workers but the job has {proc.world_size}")
        lock = _lock_checkpoint_dir(cfg, proc.rank)     # before anything is written there
        closers: list[Callable[[], object]] = []
        # steps completed (for the exit note) and when this worker got how far (the restart record)
        progress: dict = {"done": 0, "milestones": {**(milestones or {}), "config": entered, "model": captured}}
        guard = FailureGuard(default_store(), rank=proc.rank, world_size=proc.world_size,
                             timeout=min(cfg.peer_timeout, cfg.training.timeout), program="hybridpipe.launch",
                             describe=describe_ranks(cfg.plan), on_exit=[lambda: _close_all(closers)],
                             hint="restart with --resume to continue from the newest checkpoint"
                             if cfg.checkpoint_dir else "")
        if cfg.checkpoint_dir:              # a peer died: leave a note for the restart (restarts.py)
            root = cfg.checkpoint_dir

            def leave_note() -> None:
                if guard.exit_code == EXIT_PEER_LOST:
                    note_exit(root, guard.rank, guard.world_size, int(progress["done"]))
            guard.on_exit.append(leave_note)
        if lock is not None:
            guard.on_exit.append(lock.release)
        with guard:
            summary = _train(cfg, proc, model, closers, print_fn, init_optimizer, progress, guard)
    finally:
        if lock is not None:
            lock.release()
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def _lock_checkpoint_dir(cfg: RunConfig, rank: int) -> DirLock | None:
    """Rank 0 locks ``--checkpoint-dir`` for the job's life (runtime/dirlock.py); every rank learns
    the outcome (collective): UserError on every rank when another job has it, nothing written."""
    return lock_for_job(cfg.checkpoint_dir, rank) if cfg.checkpoint_dir else None


@dataclass
class _Run:
    """What launch's loop knows about this rank's run once it has started."""

    cfg: RunConfig
    rank: int
    stages: tuple[Stage, ...]               # the rank's stage, or its model chunks (virtual stages)
    replica: int
    reporter: bool                          # the last stage's first replica: it writes the summary
    device: torch.device
    run_dir: Path
    traces: Path | None                     # the timeline's folder (None: no timeline)
    recorder: TimelineRecorder | None


def _train(cfg: RunConfig, proc: Process, model: Model, closers: list, print_fn, init_optimizer: dict | None,
           progress: dict, guard: FailureGuard) -> dict | None:
    """launch's loop around the Python API (runtime/trainer.py): metrics, progress bar, timeline,
    checkpoints every K steps (each inside ``guard.critical``: a stop signal lets it finish), with
    ``--in-place`` the recovery of a lost replica (runtime/recovery.py), the summary."""
    critical = guard.critical
    run = _open_run(cfg, proc, closers, print_fn)
    model.keep_capture()                    # into RUN_DIR/capture/ (now there): a restart reads it
    trainer = _make_trainer(run, model)
    recover = recoverer(cfg, proc, trainer, guard) if cfg.training.in_place else None
    held_out = make_eval_data(cfg, model.spec) if cfg.eval_every else None
    if init_optimizer is not None:
        _load_optimizer(trainer, model, init_optimizer)
    start, restart = _resume(run, trainer, proc.world_size, progress, print_fn)
    progress["done"] = start
    metrics = MetricsWriter(run.run_dir, run.rank)
    closers.append(metrics.close)
    report = RankReport(run.rank, run.stages[0].index, run.replica, more_stages=tuple(s.index for s in run.stages[1:]),
                        allocator_peak=run.device.type == "cuda",
                        threads=torch.get_num_threads() if run.device.type == "cpu" else 0)
    saved_at, report, events = _steps(run, trainer, metrics, report, held_out, start, restart, progress, critical,
                                      recover)
    if cfg.checkpoint_dir and saved_at < cfg.steps:          # the final weights, always
        with critical:
            trainer.save(cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
    trainer.close()
    _close_all(closers)
    proc = trainer.proc                             # the survivors' world after an in-place recovery
    _report_replicas(report, trainer, tuple(trainer.stage_plans))
    reports: list = [None] * proc.world_size
    dist.all_gather_object(reports, report)
    if events:              # the agents of the lost hosts never reach torchrun's exit barrier
        hosts: list = [None] * proc.world_size
        dist.all_gather_object(hosts, os.environ.get("GROUP_RANK"))
        if proc.rank == 0:
            log.info(release_exit_barrier(int(os.environ.get("GROUP_WORLD_SIZE", "0")) - len(set(hosts))))
    reporter = proc.rank == trainer.plan.stages[-1].ranks[0]
    return _summary(run, trainer, reports, start, print_fn, events) if reporter else None


def _open_run(cfg: RunConfig, proc: Process, closers: list, print_fn) -> _Run:
    """The run directory (every rank agrees on rank 0's), the plan it runs written there (autotune --runs
    ranks an earlier run's plan by it), and this rank's timeline recorder."""
    plan, rank = cfg.plan, proc.rank
    stage_plans, replica = plan.stages_of_rank(rank)      # one, or the rank's model chunks (virtual stages)
    run_dir = _agree_run_dir(cfg, rank)
    if rank == 0:                                         # what the run ran, beside what it measured
        save_plan(plan, run_dir / "plan.json")
    if cfg.planned_s is not None and rank == 0:
        print_fn(f"hybridpipe: planned {len(plan.stages)} stage(s) x replicas "
                 f"{[s.replicas for s in plan.stages]} for {plan.world_size} workers in {cfg.planned_s:.2f} s; "
                 f"wrote {run_dir / 'plan.json'}")
    traces = None if cfg.trace_dir == "" else Path(cfg.trace_dir or trace_dir(run_dir))
    recorder = None
    if traces is not None:
        recorder = TimelineRecorder(traces, rank=rank, stage=stage_plans[0].index, replica=replica,
                                    world_size=proc.world_size, label=f"{plan.model} {cfg.schedule}",
                                    stages=[s.index for s in stage_plans])
        closers.append(recorder.close)
    return _Run(cfg, rank, stage_plans, replica, rank == plan.stages[-1].ranks[0], proc.device, run_dir, traces,
                recorder)


def _make_trainer(run: _Run, model: Model) -> Trainer:
    """The Python API's Trainer with launch's options."""
    cfg = run.cfg
    trainer = Trainer(model, cfg.plan, cfg.training, recorder=run.recorder, data=make_data(cfg, model.spec),
                      locked_dir=cfg.checkpoint_dir or None,
                      lr_scheduler=lr_schedule(cfg.lr_schedule, warmup=cfg.warmup_steps, total=cfg.steps))
    if cfg.checkpoint_dir:
        trainer.watch.hint = f"the newest checkpoint in {cfg.checkpoint_dir} is the last good one"
    return trainer


def _load_optimizer(trainer: Trainer, model: Model, state: dict) -> None:
    """``--init-from``'s name-keyed optimizer state into the trainer's optimizer."""
    canon = canonical_names(tied_parameters(model.module))
    with trainer.gathered() as module:          # ZeRO-3: its names only, but trainer.module is freed
        names = optimizer_names(trainer.optimizer, module, canon)
    trainer.optimizer.load_state_dict(indexed_optimizer_state(state, names, trainer.optimizer.state_dict()))


def _resume(run: _Run, trainer: Trainer, world_size: int, progress: dict, print_fn) -> tuple[int, dict | None]:
    """``--resume``: the step the newest checkpoint continues from (0 without one) and, on the
    reporting rank, the restart record its first step completes (runtime/restarts.py)."""
    cfg, plan = run.cfg, run.cfg.plan
    if not (cfg.checkpoint_dir and cfg.resume):
        return 0, None
    t_load = time.perf_counter()
    start = _restore(trainer, cfg.checkpoint_dir, print_fn if run.rank == plan.stages[0].ranks[0] else None)
    if not run.reporter:
        return start, None
    stages = {**progress["milestones"], "job": time.time() - (time.perf_counter() - t_load)}
    stages = stages if "imports" in stages else {"imports": stages.pop("config"), **stages}   # without launch
    return start, restart_entry(read_notes(Path(cfg.checkpoint_dir)), world_size=world_size, resumed_from=start,
                                started=process_start_time(), planning_s=cfg.planned_s or 0.0,
                                load_s=time.perf_counter() - t_load, stages={f"{k}_s": t for k, t in stages.items()})


def _steps(run: _Run, trainer: Trainer, metrics: MetricsWriter, report: RankReport, held_out: MicroBatches | None,
           start: int, restart: dict | None, progress: dict, critical: AbstractContextManager,
           recover: Callable[..., dict] | None) -> tuple[int, RankReport, list[dict]]:
    """Steps ``start`` to the last, each recorded (metrics, progress bar, the rank's report), held-out
    losses and checkpoints when due; the steps the last checkpoint saved, the rank's report (renamed
    after an in-place recovery) and the recoveries' events."""
    cfg = run.cfg
    bar = Progress(cfg.steps, initial=start, enabled=cfg.progress and run.reporter,
                   desc=f"{cfg.plan.model} {cfg.schedule}")
    saved_at = start
    if held_out is not None and start < cfg.steps:        # the held-out loss before training
        metrics.write({"step": start - 1, "eval_loss": _evaluate(trainer, held_out, cfg.eval_batches)})
    events: list[dict] = []                  # in-place recoveries, for the summary without a checkpoint dir
    try:
        for step in range(start, cfg.steps):
            evaluate = cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1)
            due = bool(cfg.checkpoint_dir) and cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0
            # every rank: stops on a non-finite loss; pipedream drains before an evaluation or a checkpoint
            record, seconds, event = _step(run, trainer, step, drain=step == cfg.steps - 1 or evaluate or due,
                                           recover=recover)
            _note_step(report, trainer, step, record)
            if evaluate:
                record["eval_loss"] = _evaluate(trainer, held_out, cfg.eval_batches)
            metrics.write(record)
            bar.update(record)
            progress["done"] = step + 1
            if restart is not None and cfg.checkpoint_dir:
                append_log(Path(cfg.checkpoint_dir), first_step_done(restart, seconds))
                restart = None
            if event is not None:           # re-formed in place during this step: the new reporter records it
                report = renamed_report(report, trainer)
                before = event.pop("before_s")
                events.append(first_step_done(event, seconds - before))
                if trainer.proc.rank == trainer.plan.stages[-1].ranks[0] and cfg.checkpoint_dir:
                    append_log(Path(cfg.checkpoint_dir), events[-1])
            if due and cfg.checkpoint_dir:
                with critical:
                    trainer.save(cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
                saved_at = step + 1
    except Exception as e:
        if recover is None or suspect_of(e)[1] == "own":
            raise
        recover(e, "outside a step")        # a failure outside a training step: the job restarts
        raise
    finally:
        bar.close()
    return saved_at, report, events


def _step(run: _Run, trainer: Trainer, step: int, *, drain: bool,
          recover: Callable[..., dict] | None) -> tuple[dict, float, dict | None]:
    """One training step, timed (and on the timeline); its metrics record, seconds and the in-place
    recovery's event during it (None without one)."""
    if run.recorder is not None:
        run.recorder.begin_step(step)
    t0 = time.perf_counter()
    lr = trainer.lr
    event = train_step_recovering(trainer, drain, recover)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    seconds = time.perf_counter() - t0
    if run.recorder is not None:
        run.recorder.end_step()
    tokens = trainer.last_tokens
    record = step_record(step, seconds, run.cfg.global_batch, list(trainer.last_losses.values()),
                         trainer.last_peak_memory_bytes, weights=list(tokens.values()) if tokens else None)
    if lr is not None:
        record["lr"] = lr
    if trainer.last_grad_norm is not None:
        record["grad_norm"] = round(trainer.last_grad_norm, 6)
    if trainer.scaler is not None:
        record["loss_scale"] = trainer.scaler.scale
    return record, seconds, event


def _note_step(report: RankReport, trainer: Trainer, step: int, record: dict) -> None:
    """The step in the rank's report: its time, peak memory and (last stage) losses and tokens."""
    report.peak_memory_bytes = max(report.peak_memory_bytes, trainer.last_peak_memory_bytes)
    report.step_ms[step] = record["step_ms"]
    if trainer.last_losses:
        report.losses[step] = trainer.last_losses
    if trainer.last_tokens:
        report.tokens[step] = trainer.last_tokens


def _report_replicas(report: RankReport, trainer: Trainer, stages: tuple[Stage, ...]) -> None:
    """A replicated stage's digests (weights, buffers), combined statistics and the sync it ran."""
    if stages[0].replicas == 1:
        return
    report.digest = weights_digest(trainer.module)
    report.buffers = buffers_digest(trainer.module)
    report.combined = {st.index: st.stats.buffers for st in trainer.stages if st.stats and st.stats.combines}
    report.sync = sync_report(trainer.syncs[stages[0].index], stages[0])
    report.more_sync = {s.index: ran for s in stages[1:] if (ran := sync_report(trainer.syncs[s.index], s)) is not None}


def _summary(run: _Run, trainer: Trainer, reports: list, start: int, print_fn, events: list[dict]) -> dict:
    """The job's summary from every rank's report (the survivors' plan after an in-place recovery):
    written to the run directory and printed."""
    cfg = run.cfg
    summary = summarize(reports, trainer.plan, steps=cfg.steps, first_step=start, run_dir=str(run.run_dir),
                        trace_dir=str(run.traces) if run.traces is not None else None, schedule=cfg.schedule,
                        config=trainer.config, skipped=trainer.watch.skipped)
    if cfg.checkpoint_dir or events:
        summary["restarts"] = read_log(Path(cfg.checkpoint_dir)) if cfg.checkpoint_dir else events
    write_json(Path(run.run_dir) / "summary.json", summary)
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
