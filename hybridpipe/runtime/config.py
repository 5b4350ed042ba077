"""launch's arguments and the run configuration they resolve to (no processes; reads the plan and
calibrations, and checks the output directories without creating anything).

The plan supplies the defaults (model, batch size, micro-batches, schedule, optimizer); an
argument may override what the plan leaves open (micro-batches, schedule, optimizer) and must
agree with what it fixes (model, batch size, world size): a plan made for something else is
refused with one line saying how to fix it. The training settings' flags come from
runtime/training_config.py's TrainingConfig (the Trainer's settings, one definition).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from hybridpipe.argtypes import Parser, check_output_dir, memory_gb, nonneg_int, output_dir, positive_int, timeout_s
from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory
from hybridpipe.partitioner.cost.calibration import load_calibration
from hybridpipe.partitioner.plan import STRATEGIES, Plan, check_plan_fits, check_plan_memory, load_plan
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.pipeline.schedules import Topology, check_schedulable
from hybridpipe.runtime.checkpoint_files import check_fresh
from hybridpipe.runtime.lr import SCHEDULES as LR_SCHEDULES
from hybridpipe.runtime.training_config import TrainingConfig


@dataclass(frozen=True)
class RunConfig:
    """Everything a worker needs, resolved against the plan (``plan`` carries the overrides;
    ``training`` the Trainer's settings, the plan's defaults filled in)."""

    plan: Plan
    plan_path: str
    model: str
    dataset: str
    dataset_size: int | None          # synthetic samples (None: one pass, steps x global batch)
    steps: int
    training: TrainingConfig
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    resume: bool
    trace_dir: str | None             # None: RUN_DIR/trace; "" disables the timeline
    peer_timeout: float
    run_dir: str | None               # None: runs/<timestamp>, chosen by rank 0
    progress: bool
    verbose: bool
    lr_schedule: str = "constant"     # runtime/lr.py: constant, linear or cosine (after the warm-up)
    warmup_steps: int = 0
    shuffle: bool = False             # a seeded permutation of the dataset every epoch
    eval_every: int = 0               # held-out evaluation every K steps (0: never)
    eval_batches: int = 1             # global batches per evaluation
    eval_dataset: str | None = None   # None: synthetic held-out samples (another seed)
    init_from: str | None = None      # a state_dict, merged checkpoint, .safetensors or HF directory to start from
    planned_s: float | None = None    # seconds rank 0 spent planning (--profile), None with --plan

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


def build_parser() -> Parser:
    """The argument parser of ``hybridpipe.launch`` (every number checked by its type: a bad one
    is one line, exit 2, before anything starts)."""
    p = Parser(
        prog="hybridpipe.launch",
        description="Train with a hybridpipe plan: one process per worker, started by torchrun "
                    "(e.g. torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan plan.json "
                    "--steps 100).")
    p.add_argument("--plan", metavar="PLAN.json", help="plan written by `hybridpipe partition` (or --profile)")
    g = p.add_argument_group("planning at start (instead of --plan; elastic restarts re-plan)")
    g.add_argument("--profile", metavar="PROFILE.json",
                   help="rank 0 partitions this profile for the job's actual WORLD_SIZE, broadcasts the plan and "
                        "writes it to RUN_DIR/plan.json (needs --cluster)")
    g.add_argument("--cluster", metavar="C.json", help="the cluster whose first WORLD_SIZE workers run the job")
    g.add_argument("--strategy", choices=STRATEGIES, default="optimal", help="partitioning strategy (default optimal)")
    g.add_argument("--memory-gb", type=memory_gb, metavar="X", help="memory per worker (default: the cluster's)")
    g.add_argument("--stages", type=positive_int, metavar="S", help="uniform/params strategies: S stages")
    groups = {"data": p.add_argument_group("model and data")}
    g = groups["data"]
    g.add_argument("--model", metavar="SPEC", help="zoo name or package.module:factory (default: the plan's; "
                   "must match it)")
    g.add_argument("--dataset", default="synthetic", metavar="SPEC",
                   help="synthetic (default) or package.module:factory returning a map-style Dataset of "
                        "(input, target)")
    g.add_argument("--shuffle", action="store_true",
                   help="take the samples in a new seeded permutation every epoch (as DistributedSampler with "
                        "--seed), the same on every rank (default: in order)")
    g.add_argument("--dataset-size", type=positive_int, metavar="N",
                   help="samples in the synthetic dataset (default: steps x global batch, no sample repeats)")
    g = groups["training"] = p.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=50,
                   help="training steps, one step = micro-batches x micro-batch size samples (default 50)")
    g.add_argument("--micro-batch-size", type=positive_int, metavar="B",
                   help="samples per micro-batch (default: the plan's; must match it)")
    g.add_argument("--batch-size", type=positive_int, metavar="B",
                   help="deprecated: the old name of --micro-batch-size")
    add_micro_batches_option(g)
    add_schedule_option(g)
    groups["communication"] = p.add_argument_group("communication")
    TrainingConfig.add_arguments(p, groups)     # the Trainer's settings (runtime/training_config.py)
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="learning rate after the warm-up: constant (default), linear or cosine decay to 0 at "
                        "--steps (stepped once per training step on every stage)")
    g.add_argument("--warmup-steps", type=nonneg_int, default=0, metavar="N",
                   help="raise the learning rate linearly over the first N steps (default 0)")
    g.add_argument("--eval-every", type=nonneg_int, default=0, metavar="K",
                   help="evaluate on held-out data every K steps and after the last (forward only, evaluation "
                        "mode; in the metrics and the progress bar; default 0: never)")
    g.add_argument("--eval-batches", type=positive_int, default=1, metavar="N",
                   help="global batches per evaluation (default 1)")
    g.add_argument("--eval-dataset", metavar="SPEC",
                   help="held-out data, as --dataset (default: synthetic samples of another seed; required "
                        "with a --dataset of your own)")
    g = groups["communication"]
    g.add_argument("--peer-timeout", type=timeout_s, default=30.0, metavar="S",
                   help="seconds without a heartbeat before a rank on another host counts as lost (default 30; "
                        "every wait is bounded by the shorter of --timeout and --peer-timeout)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", type=output_dir, metavar="D",
                   help="write checkpoints here (shared by every node)")
    g.add_argument("--checkpoint-every", type=nonneg_int, default=0, metavar="K",
                   help="checkpoint every K steps (0: never)")
    g.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="N",
                   help="keep the N newest good (SHA-256 verified) checkpoints of this training (default 3; "
                        "corrupt ones are moved aside, others' are never deleted)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest usable checkpoint, resharded for this plan if another plan "
                        "wrote it (an empty --checkpoint-dir starts afresh)")
    g.add_argument("--init-from", metavar="MODEL.pt",
                   help="start a new run from these weights: a state_dict of the model, the output of "
                        "`hybridpipe merge-checkpoint` (with --with-optimizer: its optimizer state too), a "
                        ".safetensors file or a save_pretrained directory; with --resume, only when there is no "
                        "checkpoint yet")
    g.add_argument("--run-dir", type=output_dir, metavar="R",
                   help="metrics, timeline and summary go here (default runs/<time>)")
    g.add_argument("--trace-dir", type=output_dir, metavar="T", help="per-rank timeline traces (default RUN_DIR/trace)")
    g.add_argument("--no-trace", action="store_true", help="record no timeline")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="log what every rank does")
    return p


def deprecations(args: argparse.Namespace) -> list[str]:
    """One line per deprecated option the user gave (printed as warnings by launch)."""
    if args.batch_size is not None:
        return ["--batch-size is deprecated (it always meant samples per micro-batch); use --micro-batch-size"]
    return []


def resolve(args: argparse.Namespace, world_size: int | None = None, planned: Plan | None = None,
            planned_s: float | None = None) -> RunConfig:
    """Check ``args`` against the plan, each other and the file system; the effective plan
    carries the overrides. Fast (no model, no processes).

    ``world_size`` (the job's, from torchrun's environment) must be the plan's. ``planned`` is
    the plan made at start from ``--profile`` (runtime/replan.py), used instead of ``--plan``.
    """
    check_plan_source(args)
    if args.init_from is not None and not (Path(args.init_from).is_file() or Path(args.init_from).is_dir()):
        raise UserError(f"--init-from {args.init_from}: no such file; pass a state_dict saved with torch.save, "
                        "the output of `hybridpipe merge-checkpoint`, a .safetensors file or a save_pretrained "
                        "directory")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        raise UserError("--checkpoint-every and --resume need --checkpoint-dir D (a directory every node can reach)")
    micro_batch_size = args.micro_batch_size if args.micro_batch_size is not None else args.batch_size
    if None not in (args.micro_batch_size, args.batch_size) and args.micro_batch_size != args.batch_size:
        raise UserError(f"--micro-batch-size {args.micro_batch_size} and (deprecated) --batch-size {args.batch_size} "
                        "differ; give only --micro-batch-size")
    training = TrainingConfig.from_args(args)
    for path in training.calibrations:
        if not Path(path).is_file():
            raise UserError(f"calibration file {path} does not exist; run `hybridpipe bench-allreduce -o {path}`")
        load_calibration(path)
    plan = planned if planned is not None else load_plan(args.plan)
    check_plan_fits(plan, model=args.model, batch_size=micro_batch_size, world_size=world_size)
    plan = dataclasses.replace(plan, micro_batches=args.micro_batches or plan.micro_batches,
                               schedule=args.schedule or plan.schedule,
                               optimizer=training.optimizer or plan.optimizer,
                               precision=training.precision or plan.precision,
                               loss_normalization=training.loss_normalization or plan.loss_normalization)
    require_memory(plan.micro_batches * 6 * 400 * 2, f"the instruction lists of {plan.micro_batches} micro-batches",
                   "use fewer --micro-batches")
    check_schedulable(Topology.from_plan(plan), plan.kind)
    check_plan_memory(plan)
    training = training.for_plan(plan)          # the plan's defaults filled in, checked against its schedule
    if args.eval_every and args.dataset != "synthetic" and not args.eval_dataset:
        raise UserError("--eval-every with your own --dataset needs --eval-dataset SPEC (the held-out samples)")
    if args.eval_every and training.comm_mode == "sra":
        raise UserError("--eval-every needs --comm-mode sa or per-tensor: sra channels follow the training "
                        "step's fixed order of transfers")
    if args.run_dir is None:
        check_output_dir("runs", "run directory")
    if args.checkpoint_dir:
        check_checkpoint_dir(args.checkpoint_dir, resume=args.resume)
    return RunConfig(
        plan=plan, plan_path=str(args.plan or ""), model=plan.model, dataset=args.dataset,
        dataset_size=args.dataset_size, steps=args.steps, training=training,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        trace_dir="" if args.no_trace else args.trace_dir, peer_timeout=args.peer_timeout,
        run_dir=args.run_dir, progress=not args.no_progress, verbose=args.verbose, lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps, eval_every=args.eval_every,
        eval_batches=args.eval_batches, eval_dataset=args.eval_dataset, shuffle=args.shuffle,
        init_from=args.init_from, planned_s=planned_s)


def check_plan_source(args: argparse.Namespace) -> None:
    """Exactly one of --plan and --profile (with --cluster)."""
    if (args.plan is None) == (args.profile is None):
        raise UserError("give either --plan PLAN.json or --profile PROFILE.json --cluster C.json (plan at start), "
                        "not both" if args.plan else "no plan: give --plan PLAN.json, or --profile PROFILE.json "
                        "--cluster C.json to plan for the job's workers at start")
    if args.profile is not None and args.cluster is None:
        raise UserError("--profile needs --cluster C.json (the cluster whose first WORLD_SIZE workers run the job)")


def check_checkpoint_dir(path: str, *, resume: bool) -> None:
    """A fresh run never writes into checkpoints it did not make: without --resume the directory
    must hold none (a resumed run continues them)."""
    if not resume:
        check_fresh(path, named=f"--checkpoint-dir {path}",
                    hint="continue them with --resume, or pass an empty --checkpoint-dir to start afresh")


def env_world_size() -> int:
    """The job's world size from torchrun's environment (1 when started without torchrun)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"WORLD_SIZE={raw!r} is not a number; start launch.py with torchrun") from None


