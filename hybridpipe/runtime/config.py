"""launch's arguments and the run configuration they resolve to (no processes; reads the plan and
calibrations, and checks the output directories without creating anything).

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

from hybridpipe.argtypes import (
    Parser,
    check_output_dir,
    memory_gb,
    nonneg_float,
    nonneg_int,
    output_dir,
    positive_float,
    positive_int,
    seed,
    timeout_s,
)
from hybridpipe.comm.hybrid_dp import POLICIES
from hybridpipe.comm.p2p import MODES
from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory
from hybridpipe.partitioner.cost.calibration import load_calibration
from hybridpipe.partitioner.plan import (
    OPTIMIZER_HELP,
    OPTIMIZERS,
    STRATEGIES,
    Plan,
    check_plan_fits,
    check_plan_memory,
    load_plan,
)
from hybridpipe.partitioner.plan_options import add_micro_batches_option, add_schedule_option
from hybridpipe.pipeline.instructions import Step
from hybridpipe.pipeline.schedules import Topology, check_schedulable, rank_program
from hybridpipe.pipeline.tokens import check_normalization
from hybridpipe.profiles.losses import LOSS_NORMALIZATIONS
from hybridpipe.runtime.checkpoint_files import step_dirs
from hybridpipe.runtime.lr import SCHEDULES as LR_SCHEDULES

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
    skip_nonfinite: bool = False      # a non-finite step is skipped (else the run stops there)
    lr_schedule: str = "constant"     # runtime/lr.py: constant, linear or cosine (after the warm-up)
    warmup_steps: int = 0
    clip_grad_norm: float | None = None   # clip by the whole model's gradient norm (None: no clipping)
    precision: str = "fp32"           # fp32, bf16 or fp16 (runtime/parts.py's PRECISIONS)
    reduce_dtype: str = "fp32"        # the dtype the replicas sum their gradients in
    shuffle: bool = False             # a seeded permutation of the dataset every epoch
    eval_every: int = 0               # held-out evaluation every K steps (0: never)
    eval_batches: int = 1             # global batches per evaluation
    eval_dataset: str | None = None   # None: synthetic held-out samples (another seed)
    init_from: str | None = None      # a state_dict, merged checkpoint, .safetensors or HF directory to start from
    planned_s: float | None = None    # seconds rank 0 spent planning (--profile), None with --plan
    in_place: bool = False            # a lost replica's survivors go on in the same processes (runtime/recovery.py)
    loss_normalization: str = "micro-batch"   # or "tokens" (profiles/losses.py); the plan's unless overridden

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
    g = p.add_argument_group("model and data")
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
    g.add_argument("--seed", type=seed, default=0, help="seed of the weights and the synthetic data (default 0)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=50,
                   help="training steps, one step = micro-batches x micro-batch size samples (default 50)")
    g.add_argument("--micro-batch-size", type=positive_int, metavar="B",
                   help="samples per micro-batch (default: the plan's; must match it)")
    g.add_argument("--batch-size", type=positive_int, metavar="B",
                   help="deprecated: the old name of --micro-batch-size")
    add_micro_batches_option(g)
    add_schedule_option(g)
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"optimizer (default: the plan's); {OPTIMIZER_HELP}")
    g.add_argument("--lr", type=positive_float, default=0.01, help="learning rate (default 0.01)")
    g.add_argument("--momentum", type=nonneg_float, default=0.9, help="SGD momentum (default 0.9; sgd only)")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="weight decay (default 0)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="learning rate after the warm-up: constant (default), linear or cosine decay to 0 at "
                        "--steps (stepped once per training step on every stage)")
    g.add_argument("--warmup-steps", type=nonneg_int, default=0, metavar="N",
                   help="raise the learning rate linearly over the first N steps (default 0)")
    g.add_argument("--clip-grad-norm", type=positive_float, metavar="X",
                   help="clip the gradients by the global norm over the whole model (across stages, after the "
                        "replicas' sync; as torch.nn.utils.clip_grad_norm_ on the unsplit model); gpipe, 1f1b")
    g.add_argument("--eval-every", type=nonneg_int, default=0, metavar="K",
                   help="evaluate on held-out data every K steps and after the last (forward only, evaluation "
                        "mode; in the metrics and the progress bar; default 0: never)")
    g.add_argument("--eval-batches", type=positive_int, default=1, metavar="N",
                   help="global batches per evaluation (default 1)")
    g.add_argument("--eval-dataset", metavar="SPEC",
                   help="held-out data, as --dataset (default: synthetic samples of another seed; required "
                        "with a --dataset of your own)")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                   help="bf16/fp16: capture the model and compute under torch.autocast, each stage as the unsplit "
                        "model under autocast; activations and gradients cross between stages in the dtype they "
                        "were computed in; weights, their gradients and optimizer state stay float32; fp16 "
                        "adds a dynamic loss scale whose overflowing steps every rank skips (gpipe, 1f1b; "
                        "default: the plan's precision, as `partition --precision` priced it)")
    g.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the dtype the replicas of a stage sum their gradients in (default fp32, as DDP under "
                        "autocast; bf16/fp16 halve the all-reduce's bytes and round each gradient to 16 bits)")
    g.add_argument("--loss-normalization", choices=LOSS_NORMALIZATIONS,
                   help="micro-batch: a step's loss is the mean of its micro-batches' mean losses; tokens: the "
                        "step's summed per-token loss over its valid tokens in all micro-batches and replicas, as "
                        "one process on the whole global batch (the loss function returns (loss_sum, count), or a "
                        "Hugging Face model counts its labels; flushed schedules; default: the plan's)")
    g.add_argument("--skip-nonfinite", action="store_true",
                   help="a step whose loss is NaN or infinite is skipped (no rank updates its weights; counted in "
                        "the summary) instead of stopping the run")
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
    g.add_argument("--aggregator", type=host_port, metavar="HOST:PORT",
                   help="address of a dedicated `hybridpipe aggregator`")
    g.add_argument("--backend", choices=BACKENDS, help="torch.distributed backend (default: nccl on GPU, else gloo)")
    g.add_argument("--timeout", type=timeout_s, default=300.0, metavar="S",
                   help="seconds any receive, send or collective may wait before the run fails (default 300)")
    g.add_argument("--peer-timeout", type=timeout_s, default=30.0, metavar="S",
                   help="seconds without a heartbeat before a rank on another host counts as lost (default 30; "
                        "every wait is bounded by the shorter of --timeout and --peer-timeout)")
    g.add_argument("--in-place", action="store_true",
                   help="when the host of a replica dies, its stage's other replicas take over its micro-batches "
                        "and the job goes on in the same processes (no restart; a stage that loses its last "
                        "replica still restarts)")
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


def host_port(text: str) -> str:
    """An argparse type: ``HOST:PORT`` with a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 1..65535), got {text!r}")
    return text


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
    for path in args.calibration:
        if not Path(path).is_file():
            raise UserError(f"calibration file {path} does not exist; run `hybridpipe bench-allreduce -o {path}`")
        load_calibration(path)
    plan = planned if planned is not None else load_plan(args.plan)
    check_plan_fits(plan, model=args.model, batch_size=micro_batch_size, world_size=world_size)
    plan = dataclasses.replace(plan, micro_batches=args.micro_batches or plan.micro_batches,
                               schedule=args.schedule or plan.schedule, optimizer=args.optimizer or plan.optimizer,
                               precision=args.precision or plan.precision,
                               loss_normalization=args.loss_normalization or plan.loss_normalization)
    require_memory(plan.micro_batches * 6 * 400 * 2, f"the instruction lists of {plan.micro_batches} micro-batches",
                   "use fewer --micro-batches")
    check_schedulable(Topology.from_plan(plan), plan.kind)
    check_plan_memory(plan)
    if args.skip_nonfinite and not flushes(plan):
        raise UserError(f"--skip-nonfinite needs a schedule that flushes every step (gpipe, 1f1b); "
                        f"{plan.schedule} updates weights per micro-batch, so a step cannot be skipped as a whole")
    if plan.precision == "fp16" and not flushes(plan):
        raise UserError(f"--precision fp16's loss scaler skips overflowing steps on every stage at once, and "
                        f"{plan.schedule} has no global step; use --precision bf16, or --schedule 1f1b or gpipe")
    check_normalization(plan.loss_normalization, flushes(plan), plan.schedule)
    if args.clip_grad_norm is not None and not flushes(plan):
        raise UserError(f"--clip-grad-norm needs a global step, and {plan.schedule} updates each stage on its own; "
                        "use --schedule 1f1b or gpipe, or drop --clip-grad-norm")
    if args.in_place and (not flushes(plan) or plan.virtual_stages > 1 or args.aggregator):
        raise UserError("--in-place needs a schedule that flushes every step with one stage per rank (gpipe, 1f1b, "
                        f"zb-h1) and no --aggregator; got {plan.schedule}"
                        + (f" with {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else "")
                        + (f" and --aggregator {args.aggregator}" if args.aggregator else ""))
    if args.in_place and plan.loss_normalization == "tokens":
        raise UserError("--in-place cannot re-form token-weighted loss normalization's counts yet; use "
                        "--loss-normalization micro-batch, or drop --in-place (a lost replica then restarts the job)")
    if args.eval_every and args.dataset != "synthetic" and not args.eval_dataset:
        raise UserError("--eval-every with your own --dataset needs --eval-dataset SPEC (the held-out samples)")
    if args.eval_every and args.comm_mode == "sra":
        raise UserError("--eval-every needs --comm-mode sa or per-tensor: sra channels follow the training "
                        "step's fixed order of transfers")
    if args.run_dir is None:
        check_output_dir("runs", "run directory")
    if args.checkpoint_dir:
        check_checkpoint_dir(args.checkpoint_dir, resume=args.resume)
    return RunConfig(
        plan=plan, plan_path=str(args.plan or ""), model=plan.model, dataset=args.dataset,
        dataset_size=args.dataset_size,
        steps=args.steps, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        comm_mode=args.comm_mode, allreduce=args.allreduce, calibrations=tuple(args.calibration),
        aggregator=args.aggregator, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        trace_dir="" if args.no_trace else args.trace_dir, timeout=args.timeout, peer_timeout=args.peer_timeout,
        seed=args.seed, backend=args.backend, run_dir=args.run_dir, progress=not args.no_progress,
        verbose=args.verbose, skip_nonfinite=args.skip_nonfinite, lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm, eval_every=args.eval_every,
        eval_batches=args.eval_batches, eval_dataset=args.eval_dataset, shuffle=args.shuffle,
        precision=plan.precision, reduce_dtype=args.reduce_dtype, init_from=args.init_from, planned_s=planned_s,
        loss_normalization=plan.loss_normalization, in_place=args.in_place)


def check_plan_source(args: argparse.Namespace) -> None:
    """Exactly one of --plan and --profile (with --cluster)."""
    if (args.plan is None) == (args.profile is None):
        raise UserError("give either --plan PLAN.json or --profile PROFILE.json --cluster C.json (plan at start), "
                        "not both" if args.plan else "no plan: give --plan PLAN.json, or --profile PROFILE.json "
                        "--cluster C.json to plan for the job's workers at start")
    if args.profile is not None and args.cluster is None:
        raise UserError("--profile needs --cluster C.json (the cluster whose first WORLD_SIZE workers run the job)")


def flushes(plan: Plan) -> bool:
    """Whether every rank of the plan's schedule takes exactly one optimizer step per step, after
    all its micro-batches (so a step can be checked, and skipped, before any weight changes)."""
    topo = Topology.from_plan(plan)
    return all(sum(isinstance(ins, Step) for ins in rank_program(topo, r, plan.kind)) == 1
               for ranks in topo.stage_ranks for r in ranks)


def check_checkpoint_dir(path: str, *, resume: bool) -> None:
    """A fresh run never writes into checkpoints it did not make: without --resume the directory
    must hold none (a resumed run continues them)."""
    found = sorted(step_dirs(path).values())
    if found and not resume:
        names = ", ".join(p.name for p in found[-3:])
        more = " ..." if len(found) > 3 else ""
        raise UserError(f"--checkpoint-dir {path} already holds checkpoints ({names}{more}); "
                        "continue them with --resume, or pass an empty --checkpoint-dir to start afresh")


def env_world_size() -> int:
    """The job's world size from torchrun's environment (1 when started without torchrun)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"WORLD_SIZE={raw!r} is not a number; start launch.py with torchrun") from None


