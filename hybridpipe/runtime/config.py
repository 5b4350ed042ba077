"""launch.py's arguments and the run configuration they resolve to (pure: no processes, no I/O but the plan).

The plan supplies the defaults (model, batch size, micro-batches, schedule, optimizer); an
argument may override what the plan leaves open (micro-batches, schedule, optimizer) and must
agree with what it fixes (model, batch size, world size): a plan made for something else is
refused with one line saying how to fix it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from hybridpipe.comm.hybrid_dp import POLICIES
from hybridpipe.comm.p2p import MODES
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import OPTIMIZERS, SCHEDULES, Plan, check_plan_fits, load_plan
from hybridpipe.pipeline.schedules import Topology, check_schedulable

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class RunConfig:
    """Everything a worker needs, resolved against the plan (``plan`` carries the overrides)."""

    plan: Plan
    plan_path: str
    model: str
    dataset: str
    dataset_size: int | None          # synthetic samples (None: one pass, steps x global batch)
    steps: int
    lr: float
    momentum: float
    weight_decay: float
    comm_mode: str
    allreduce: str | None             # None: each layer as the plan says; else an override
    calibrations: tuple[str, ...]
    aggregator: str | None
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    trace_dir: str | None             # None: RUN_DIR/trace; "" disables the timeline
    timeout: float
    peer_timeout: float
    seed: int
    backend: str | None               # None: nccl when CUDA is available, else gloo
    run_dir: str | None               # None: runs/<timestamp>, chosen by rank 0
    progress: bool
    verbose: bool

    @property
    def schedule(self) -> str:
        return self.plan.schedule

    @property
    def micro_batches(self) -> int:
        return self.plan.micro_batches

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def optimizer(self) -> str:
        return self.plan.optimizer

    @property
    def global_batch(self) -> int:
        return self.plan.batch_size * self.plan.micro_batches


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of launch.py."""
    p = argparse.ArgumentParser(
        prog="launch.py",
        description="Train with a hybridpipe plan: one process per worker, started by torchrun "
                    "(e.g. torchrun --standalone --nproc-per-node 4 launch.py --plan plan.json --steps 100).")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="plan written by `hybridpipe partition`")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", metavar="SPEC", help="zoo name or package.module:factory (default: the plan's; "
                   "must match it)")
    g.add_argument("--dataset", default="synthetic", metavar="SPEC",
                   help="synthetic (default) or package.module:factory returning a map-style Dataset of "
                        "(input, target)")
    g.add_argument("--dataset-size", type=int, metavar="N",
                   help="samples in the synthetic dataset (default: steps x global batch, no sample repeats)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data (default 0)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=50,
                   help="training steps, one step = micro-batches x batch size (default 50)")
    g.add_argument("--batch-size", type=int, metavar="B", help="samples per micro-batch (default: the plan's; "
                   "must match it)")
    g.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per step (default: the plan's)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default: the plan's)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer (default: the plan's)")
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9; sgd only)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    g = p.add_argument_group("communication")
    g.add_argument("--comm-mode", choices=MODES, default="sa",
                   help="p2p channels: per-tensor (PipeDream's threads), sa (default: one send + one receive "
                        "thread per peer), sra (one thread per peer following the schedule's order)")
    g.add_argument("--allreduce", choices=POLICIES,
                   help="override the plan's per-layer gradient sync: one algorithm for every layer, or hybrid "
                        "(re-decide per layer by the cost model); default: as the plan says")
    g.add_argument("--calibration", action="append", default=[], metavar="CAL.json",
                   help="`hybridpipe bench-allreduce` output: re-decide the plan's per-layer sync with these "
                        "measured costs (an override; repeatable)")
    g.add_argument("--aggregator", metavar="HOST:PORT", help="address of a dedicated `hybridpipe aggregator`")
    g.add_argument("--backend", choices=BACKENDS, help="torch.distributed backend (default: nccl on GPU, else gloo)")
    g.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds any receive, send or collective may wait before the run fails (default 300)")
    g.add_argument("--peer-timeout", type=float, default=30.0, metavar="S",
                   help="seconds without a heartbeat before a rank on another host counts as lost (default 30)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", metavar="D", help="write checkpoints here (shared by every node)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0: never)")
    g.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                   help="keep the N newest checkpoints (default 3)")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    g.add_argument("--run-dir", metavar="R", help="metrics, timeline and summary go here (default runs/<time>)")
    g.add_argument("--trace-dir", metavar="T", help="per-rank timeline traces (default RUN_DIR/trace)")
    g.add_argument("--no-trace", action="store_true", help="record no timeline")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="log what every rank does")
    return p


def resolve(args: argparse.Namespace, world_size: int | None = None) -> RunConfig:
    """Check ``args`` against the plan and each other; the effective plan carries the overrides.

    ``world_size`` (the job's, from torchrun's environment) must be the plan's.
    """
    _positive(args.steps, "--steps")
    _positive(args.timeout, "--timeout")
    _positive(args.peer_timeout, "--peer-timeout")
    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if args.dataset_size is not None:
        _positive(args.dataset_size, "--dataset-size")
    if args.checkpoint_every < 0:
        raise UserError(f"--checkpoint-every must be >= 0 (0: never), got {args.checkpoint_every}")
    if args.keep_checkpoints < 1:
        raise UserError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise UserError("--checkpoint-every and --resume need --checkpoint-dir D (a directory every node can reach)")
    for path in args.calibration:
        if not Path(path).is_file():
            raise UserError(f"calibration file {path} does not exist; run `hybridpipe bench-allreduce -o {path}`")
    plan = load_plan(args.plan)
    check_plan_fits(plan, model=args.model, signature=None, batch_size=args.batch_size, world_size=world_size)
    if args.micro_batches is not None:
        _positive(args.micro_batches, "--micro-batches")
    plan = dataclasses.replace(plan, micro_batches=args.micro_batches or plan.micro_batches,
                               schedule=args.schedule or plan.schedule, optimizer=args.optimizer or plan.optimizer)
    check_schedulable(Topology.from_plan(plan), plan.schedule)
    if args.momentum < 0 or args.weight_decay < 0:
        raise UserError("--momentum and --weight-decay must be >= 0")
    return RunConfig(
        plan=plan, plan_path=str(args.plan), model=plan.model, dataset=args.dataset, dataset_size=args.dataset_size,
        steps=args.steps, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        comm_mode=args.comm_mode, allreduce=args.allreduce, calibrations=tuple(args.calibration),
        aggregator=args.aggregator, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        trace_dir="" if args.no_trace else args.trace_dir, timeout=args.timeout, peer_timeout=args.peer_timeout,
        seed=args.seed, backend=args.backend, run_dir=args.run_dir, progress=not args.no_progress,
        verbose=args.verbose)


def env_world_size() -> int:
    """The job's world size from torchrun's environment (1 when started without torchrun)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"WORLD_SIZE={raw!r} is not a number; start launch.py with torchrun") from None


def _positive(value: float, name: str) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")
