"""One worker process: join the job, build this rank's part of the pipeline, train, report.

    cfg = resolve(build_parser().parse_args(argv), env_world_size())
    summary = run_worker(cfg)          # every rank; the summary on the reporting rank, else None

The order of collective calls is the same on every rank: the run directory (broadcast), the
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import write_json
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline import PipelineEngine, Topology, build_stage_index
from hybridpipe.pipeline.stage import loss_of
from hybridpipe.profiles.capture import tied_parameters
from hybridpipe.runtime.checkpoint import Checkpointer, reseed, restore_rng
from hybridpipe.runtime.checkpoint_files import load_initial
from hybridpipe.runtime.config import RunConfig, flushes
from hybridpipe.runtime.failure import EXIT_PEER_LOST, FailureGuard, default_store, describe_ranks
from hybridpipe.runtime.groups import Process, init_distributed, replica_groups, stage_channels
from hybridpipe.runtime.metrics import MetricsWriter, Progress, step_record
from hybridpipe.runtime.nonfinite import NonFiniteWatch
from hybridpipe.runtime.parts import load_model, make_data, make_optimizer, make_sync, seed_rank, weights_digest
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
from hybridpipe.runtime.tied import tied_process_groups, tied_sync
from hybridpipe.runtime.timeline import TimelineRecorder, trace_dir

log = logging.getLogger(__name__)


def run_worker(cfg: RunConfig, *, print_fn: Callable[[str], None] = print) -> dict | None:
    """Train ``cfg`` on this process's rank (see the module docstring); returns the summary on the
    reporting rank (the last stage's first replica), None elsewhere. Joins the job torchrun
    started, or uses the default process group when the caller already made one."""
    entered = time.time()
    model = load_model(cfg)                    # before any process group: a wrong plan fails alone
    init_optimizer = load_initial(cfg.init_from, model.module) if cfg.init_from else None
    captured = time.time()
    proc, owned = init_distributed(cfg.backend, cfg.timeout)
    try:
        if proc.world_size != cfg.plan.world_size:
            raise UserError(f"the plan needs {cfg.plan.world_size} workers but the job has {proc.world_size}")
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
        with guard:
            summary = _train(cfg, proc, model, closers, print_fn, init_optimizer, progress)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def _train(cfg: RunConfig, proc: Process, model, closers: list, print_fn, init_optimizer: dict | None,
           progress: dict) -> dict | None:
    plan, rank = cfg.plan, proc.rank
    stage_plan, replica = plan.stage_of_rank(rank)
    reporter = rank == plan.stages[-1].ranks[0]
    run_dir = _agree_run_dir(cfg, rank)
    if cfg.planned_s is not None and rank == 0:
        save_plan(plan, run_dir / "plan.json")
        print_fn(f"hybridpipe: planned {len(plan.stages)} stage(s) x replicas "
                 f"{[s.replicas for s in plan.stages]} for {plan.world_size} workers in {cfg.planned_s:.2f} s; "
                 f"wrote {run_dir / 'plan.json'}")
    traces = None if cfg.trace_dir == "" else Path(cfg.trace_dir or trace_dir(run_dir))

    groups = replica_groups(plan, cfg.timeout)
    tied = tied_sync(plan, stage_plan.index, model.module, tied_process_groups(plan, cfg.timeout))
    watch = _nonfinite_watch(cfg, proc, stage_plan)
    stage = build_stage_index(model.captured, [(s.first_node, s.last_node) for s in plan.stages], stage_plan.index,
                              loss=watch.wrap_loss(loss_of(model.spec.loss))).to(proc.device)
    sync = make_sync(cfg, stage.module, stage_plan, groups.get(stage_plan.index),
                     exclude=tied.params if tied is not None else ())
    seed_rank(cfg.seed, rank)
    optimizer: Any = watch.wrap_optimizer(make_optimizer(cfg.optimizer, stage.module.parameters(), lr=cfg.lr,
                                                    momentum=cfg.momentum, weight_decay=cfg.weight_decay))
    recorder = None
    if traces is not None:
        recorder = TimelineRecorder(traces, rank=rank, stage=stage_plan.index, replica=replica,
                                    world_size=proc.world_size, label=f"{plan.model} {cfg.schedule}")
        closers.append(recorder.close)
    topo = Topology.from_plan(plan)
    channels = stage_channels(topo, rank, cfg.schedule, cfg.comm_mode, proc.device, cfg.timeout,
                              on_transfer=recorder.on_transfer if recorder else None)
    if recorder is not None:
        recorder.align(dist.barrier)
    engine = PipelineEngine(stage, topo, rank, cfg.schedule, transport=channels, optimizer=optimizer,
                            data=make_data(cfg, model.spec), sync=sync, recorder=recorder, tied=tied)

    ckpt = None
    start, restart = 0, None
    canon = canonical_names(tied_parameters(model.module))
    if init_optimizer is not None:
        names = optimizer_names(optimizer, stage.module, canon)
        optimizer.load_state_dict(indexed_optimizer_state(init_optimizer, names, optimizer.state_dict()))
    if cfg.checkpoint_dir:
        ckpt = Checkpointer(cfg.checkpoint_dir, plan=plan, rank=rank, every=cfg.checkpoint_every,
                            keep=cfg.keep_checkpoints, tied=tied_parameters(model.module))
        if cfg.resume:
            t_load = time.perf_counter()
            start = _restore(ckpt, stage, optimizer, engine, cfg.seed, print_fn if rank == ckpt.committer else None)
            if reporter:
                restart = restart_entry(read_notes(ckpt.root), world_size=proc.world_size, resumed_from=start,
                                        started=process_start_time(), planning_s=cfg.planned_s or 0.0,
                                        load_s=time.perf_counter() - t_load, stages={
                                            "imports_s": progress["entered"], "model_s": progress["captured"],
                                            "job_s": time.time() - (time.perf_counter() - t_load)})
    progress["done"] = start

    metrics = MetricsWriter(run_dir, rank)
    closers.append(metrics.close)
    report = RankReport(rank, stage_plan.index, replica)
    bar = Progress(cfg.steps, initial=start, enabled=cfg.progress and reporter,
                   desc=f"{plan.model} {cfg.schedule}")
    saved_at = start
    try:
        for step in range(start, cfg.steps):
            if recorder is not None:
                recorder.begin_step(step)
            t0 = time.perf_counter()
            due = ckpt is not None and ckpt.due(step + 1)     # pipedream drains before a checkpoint
            result = engine.run_step(step, drain=step == cfg.steps - 1 or due)
            watch.after_step(step, result.losses)       # every rank: stops here on a non-finite loss
            if proc.device.type == "cuda":
                torch.cuda.synchronize(proc.device)
            seconds = time.perf_counter() - t0
            if recorder is not None:
                recorder.end_step()
            losses = {m: float(v) for m, v in sorted(result.losses.items())}
            record = step_record(step, seconds, cfg.global_batch, list(losses.values()))
            metrics.write(record)
            bar.update(record)
            report.step_ms[step] = record["step_ms"]
            if losses:
                report.losses[step] = losses
            progress["done"] = step + 1
            if restart is not None and ckpt is not None:
                append_log(ckpt.root, first_step_done(restart, seconds))
                restart = None
            if ckpt is not None and due:
                ckpt.save(step + 1, module=stage.module, optimizer=optimizer, engine=engine.state_dict())
                saved_at = step + 1
    finally:
        bar.close()
    if ckpt is not None and saved_at < cfg.steps:          # the final weights, always
        ckpt.save(cfg.steps, module=stage.module, optimizer=optimizer, engine=engine.state_dict())

    channels.close()
    if hasattr(sync, "close"):
        sync.close()
    _close_all(closers)
    if stage_plan.replicas > 1:
        report.digest = weights_digest(stage.module)
        report.sync = sync_report(sync, stage_plan)
    reports: list = [None] * proc.world_size
    dist.all_gather_object(reports, report)
    if not reporter:
        return None
    summary = summarize(reports, plan, steps=cfg.steps, first_step=start, run_dir=str(run_dir),
                        trace_dir=str(traces) if traces is not None else None, schedule=cfg.schedule,
                        comm_mode=cfg.comm_mode, allreduce=cfg.allreduce, skipped=watch.skipped)
    if ckpt is not None:
        summary["restarts"] = read_log(ckpt.root)
    write_json(Path(run_dir) / "summary.json", summary)
    print_fn(format_summary(summary))
    return summary


def _nonfinite_watch(cfg: RunConfig, proc: Process, stage_plan) -> NonFiniteWatch:
    """The NaN/inf check of this rank (see nonfinite.py); the last stage decides alone when unreplicated."""
    last = stage_plan.index == len(cfg.plan.stages) - 1
    hint = f"the newest checkpoint in {cfg.checkpoint_dir} is the last good one" if cfg.checkpoint_dir else ""
    return NonFiniteWatch(proc.device, skip=cfg.skip_nonfinite, flushing=flushes(cfg.plan), stage=stage_plan.index,
                          decides_alone=last and stage_plan.replicas == 1, hint=hint)


def _restore(ckpt: Checkpointer, stage, optimizer, engine, seed: int, say: Callable[[str], None] | None) -> int:
    """Load the newest usable checkpoint, resharded for this plan when another wrote it (or stop:
    see Checkpointer.restore); ``say`` (one rank's print) tells the user where the run continues from."""
    restored = ckpt.restore(stage.module)
    if restored is None:
        if say is not None:
            say(f"hybridpipe: --resume: no checkpoint in {ckpt.root} yet; starting from step 0")
        return 0
    if say is not None:
        skipped = f" (skipped: {'; '.join(restored.skipped)})" if restored.skipped else ""
        moved = (f"; resharded from the plan that wrote it ({restored.resharded}); each rank's RNG re-seeded from "
                 "(--seed, rank, step)") if restored.resharded else ""
        say(f"hybridpipe: --resume: continuing from {restored.path} (step {restored.step}){skipped}{moved}")
    ckpt.load_into(restored, stage.module, optimizer)
    if restored.engine:
        engine.load_state_dict(restored.engine)
    if restored.rng is not None:
        restore_rng(restored.rng)           # after everything that draws random numbers
    else:
        reseed(seed, ckpt.rank, restored.step)
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
