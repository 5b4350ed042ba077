"""One training configuration: every setting of a run that is a value (not a Python object such as
the model, the plan, a loss function or an optimizer factory), the same from Python and from launch.

    config = TrainingConfig(lr=3e-4, optimizer="adam", clip_grad_norm=1.0)   # checked here, once
    trainer = Trainer(spec, plan, config)                 # or Trainer(spec, plan, lr=3e-4, ...)
    TrainingConfig.add_arguments(parser)                  # launch's flags, from the fields
    config = TrainingConfig.from_args(parser.parse_args())

Each field carries its type, its default and its ``help`` (the sentence ``--help`` shows) in
``field(metadata=...)``, with what the command line needs (flag, choices, argparse type from
hybridpipe/argtypes.py). A None default means "the plan's" (``optimizer``, ``precision``, ``reduce_dtype``,
``loss_normalization``: what ``partition`` priced) or "not set"; :meth:`TrainingConfig.for_plan`
fills those in and checks what needs the plan (one place, for the Trainer and launch alike).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hybridpipe.argtypes import host_port, nonneg_float, nonneg_int, positive_float, seed, timeout_s
from hybridpipe.comm.hybrid_dp import POLICIES
from hybridpipe.comm.p2p import MODES
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import OPTIMIZER_HELP, OPTIMIZERS, PRECISIONS, Plan
from hybridpipe.pipeline.instructions import Step
from hybridpipe.pipeline.schedules import Topology, rank_program
from hybridpipe.pipeline.tokens import check_normalization
from hybridpipe.profiles.losses import LOSS_NORMALIZATIONS
from hybridpipe.runtime.allocator import ALLOCATORS

BACKENDS = ("gloo", "nccl")


def setting(default: Any, help: str, *, group: str = "training", type: Callable[[str], Any] | None = None,
            choices: tuple[str, ...] | None = None, metavar: str | None = None, flag: str | None = None) -> Any:
    """A field of :class:`TrainingConfig`: its default, its one-sentence ``help`` and its flag
    (``--name-with-dashes`` unless ``flag``) in launch's argument ``group``."""
    return field(default=default, metadata={"help": help, "group": group, "type": type, "choices": choices,
                                            "metavar": metavar, "flag": flag})


@dataclass(frozen=True)
class TrainingConfig:
    """A run's training settings (see the module docstring); ``help`` of each field says what it does."""

    seed: int = setting(0, "seed of the weights and the synthetic data (default 0)", group="data", type=seed)
    optimizer: str | None = setting(None, f"optimizer (default: the plan's); {OPTIMIZER_HELP}", choices=OPTIMIZERS)
    lr: float = setting(0.01, "learning rate (default 0.01)", type=positive_float)
    momentum: float = setting(0.9, "SGD momentum (default 0.9; sgd only)", type=nonneg_float)
    weight_decay: float = setting(0.0, "weight decay (default 0)", type=nonneg_float)
    clip_grad_norm: float | None = setting(
        None, "clip the gradients by the global norm over the whole model (across stages, after the replicas' sync; "
              "as torch.nn.utils.clip_grad_norm_ on the unsplit model); gpipe, 1f1b", type=positive_float, metavar="X")
    precision: str | None = setting(
        None, "bf16/fp16: capture the model and compute under torch.autocast, each stage as the unsplit model under "
              "autocast; activations and gradients cross between stages in the dtype they were computed in; weights, "
              "their gradients and optimizer state stay float32; fp16 adds a dynamic loss scale whose overflowing "
              "steps every rank skips (gpipe, 1f1b; default: the plan's precision, as `partition --precision` "
              "priced it)", choices=PRECISIONS)
    loss_scale: float = setting(2.0**16, "fp16's initial dynamic loss scale, halved on an overflowing step and "
                                         "doubled after 2000 good ones (default 65536)", type=positive_float,
                                metavar="X")
    reduce_dtype: str | None = setting(
        None, "the dtype the replicas of a stage sum their gradients in (default: the plan's, as `partition "
              "--reduce-dtype` priced it, fp32 unless told: as DDP under autocast; bf16/fp16 halve the all-reduce's "
              "bytes and round each gradient to 16 bits)", choices=PRECISIONS)
    loss_normalization: str | None = setting(
        None, "micro-batch: a step's loss is the mean of its micro-batches' mean losses; tokens: the step's summed "
              "per-token loss over its valid tokens in all micro-batches and replicas, as one process on the whole "
              "global batch (the loss function returns (loss_sum, count), or a Hugging Face model counts its "
              "labels; flushed schedules; default: the plan's)", choices=LOSS_NORMALIZATIONS)
    skip_nonfinite: bool = setting(
        False, "a step whose loss is NaN or infinite is skipped (no rank updates its weights; counted in the "
               "summary) instead of stopping the run")
    memory_every: int = setting(
        10, "measure each rank's peak memory (summary, metrics' peak_memory_bytes) on steps 0, 1 and every Nth step: "
            "1 every step, 0 never (default 10: on the CPU a measured step counts every tensor autograd saves through "
            "hooks; asynchronous schedules measure every step unless 0)",
        type=nonneg_int, metavar="N")
    cpu_allocator: str = setting(
        "keep", "on the CPU, keep: glibc keeps freed blocks for the next micro-batch (mallopt: blocks up to 32 MiB "
                "from the heap, up to 2 GiB of free heap not handed back; no page faults refilling the activations "
                "each step, as PyTorch's CUDA caching allocator on a GPU; left alone where MALLOC_*, GLIBC_TUNABLES "
                "or LD_PRELOAD is set); system: glibc as it comes", choices=ALLOCATORS)
    comm_mode: str = setting(
        "sa", "p2p channels: per-tensor (PipeDream's threads), sa (default: one send + one receive thread per "
              "peer), sra (one thread per peer following the schedule's order)", group="communication", choices=MODES)
    allreduce: str | None = setting(
        None, "override the plan's per-layer gradient sync: one algorithm for every layer, or hybrid (re-decide per "
              "layer by the cost model); default: as the plan says", group="communication", choices=POLICIES)
    calibrations: tuple[str, ...] = setting(
        (), "`hybridpipe bench-allreduce` output: re-decide the plan's per-layer sync with these measured costs (an "
            "override; repeatable)", group="communication", metavar="CAL.json", flag="--calibration")
    aggregator: str | None = setting(None, "address of a dedicated `hybridpipe aggregator`", group="communication",
                                     type=host_port, metavar="HOST:PORT")
    backend: str | None = setting(None, "torch.distributed backend (default: nccl on GPU, else gloo)",
                                  group="communication", choices=BACKENDS)
    timeout: float = setting(300.0, "seconds any receive, send or collective may wait before the run fails "
                                    "(default 300)", group="communication", type=timeout_s, metavar="S")
    in_place: bool = setting(
        False, "when the host of a replica dies, its stage's other replicas take over its micro-batches and the job "
               "goes on in the same processes (no restart; a stage that loses its last replica still restarts)",
        group="communication")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and f.name == "calibrations":
                object.__setattr__(self, f.name, value := tuple(value))
            _check(f.name, value, hints[f.name], f.metadata)

    # ---- the command line ------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, groups: Mapping[str, Any] | None = None) -> None:
        """One flag per field on ``parser`` (or on ``groups[field's group]`` where given), its
        destination the field's name."""
        for f in fields(cls):
            meta = f.metadata
            where = (groups or {}).get(meta["group"], parser)
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                where.add_argument(flag, dest=f.name, action="store_true", help=meta["help"])
            elif isinstance(f.default, tuple):
                where.add_argument(flag, dest=f.name, action="append", default=list(f.default),
                                   metavar=meta["metavar"], help=meta["help"])
            else:
                where.add_argument(flag, dest=f.name, default=f.default, type=meta["type"], choices=meta["choices"],
                                   metavar=meta["metavar"], help=meta["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingConfig:
        """The configuration of a namespace parsed by a parser given :meth:`add_arguments`."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    # ---- against the plan ------------------------------------------------------------------
    def for_plan(self, plan: Plan) -> TrainingConfig:
        """This configuration with the plan's defaults filled in (optimizer, precision, reduce dtype, loss
        normalization), checked against what only the plan tells: the schedule's kind of step."""
        done = replace(self, optimizer=self.optimizer or plan.optimizer, precision=self.precision or plan.precision,
                       reduce_dtype=self.reduce_dtype or plan.reduce_dtype,
                       loss_normalization=self.loss_normalization or plan.loss_normalization)
        flushed = flushes(plan)
        if done.skip_nonfinite and not flushed:
            raise UserError(f"skip_nonfinite (--skip-nonfinite) needs a schedule that flushes every step (gpipe, "
                            f"1f1b); {plan.schedule} updates weights per micro-batch, so a step cannot be skipped as "
                            "a whole")
        if done.precision == "fp16" and not flushed:
            raise UserError(f"precision fp16's loss scaler skips overflowing steps on every stage at once, and "
                            f"{plan.schedule} has no global step; use precision bf16, or the 1f1b or gpipe schedule")
        check_normalization(str(done.loss_normalization), flushed, plan.schedule)
        if done.clip_grad_norm is not None and not flushed:
            raise UserError(f"clip_grad_norm (--clip-grad-norm) needs a global step, and {plan.schedule} updates "
                            "each stage on its own; use the 1f1b or gpipe schedule, or drop the clipping")
        if done.in_place and (not flushed or plan.virtual_stages > 1 or done.aggregator):
            raise UserError("in_place (--in-place) needs a schedule that flushes every step with one stage per rank "
                            f"(gpipe, 1f1b, zb-h1) and no aggregator; got {plan.schedule}"
                            + (f" with {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else "")
                            + (f" and aggregator {done.aggregator}" if done.aggregator else ""))
        if done.in_place and done.loss_normalization == "tokens":
            raise UserError("in_place (--in-place) cannot re-form token-weighted loss normalization's counts yet; "
                            "use loss normalization micro-batch, or no in-place recovery (a lost replica then "
                            "restarts the job)")
        return done


def with_settings(config: TrainingConfig | None, settings: Mapping[str, Any]) -> TrainingConfig:
    """``config`` (default: the defaults) with ``settings`` (field names) replaced, checked again."""
    names = [f.name for f in fields(TrainingConfig)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise UserError(f"unknown training setting(s) {', '.join(unknown)}; the settings are {', '.join(names)}")
    return replace(config or TrainingConfig(), **settings)


def flushes(plan: Plan) -> bool:
    """Whether every rank of the plan's schedule takes exactly one optimizer step per step, after
    all its micro-batches (so a step can be checked, and skipped, before any weight changes)."""
    topo = Topology.from_plan(plan)
    return all(sum(isinstance(ins, Step) for ins in rank_program(topo, r, plan.kind)) == 1
               for ranks in topo.stage_ranks for r in ranks)


def _check(name: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> None:
    """One field's value against its type hint, choices and argparse type: one UserError line."""
    optional = isinstance(hint, types.UnionType)            # X | None
    if optional and value is None:
        return
    want = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
    origin = typing.get_origin(want) or want
    if origin is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{name} must be a list of file names, got {value!r}")
        return
    if origin is bool:
        ok = isinstance(value, bool)
    elif origin in (int, float):
        ok = isinstance(value, int if origin is int else (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, origin)
    if not ok:
        raise UserError(f"{name} must be {_WHAT.get(origin, origin.__name__)}, got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise UserError(f"unknown {name} {value!r}; choose one of {', '.join(meta['choices'])}")
    if meta["type"] is not None:
        try:
            meta["type"](str(value))
        except argparse.ArgumentTypeError as e:
            raise UserError(f"{name} {e}" if str(e).startswith("must") else f"{name}: {e}") from None


_WHAT = {bool: "True or False", int: "a whole number", float: "a number", str: "a string"}
