"""The torch.distributed.pipelining side of ``vs_torch_pipelining.py``: torch's schedule classes run
on hybridpipe's split (the same stage GraphModules handed to torch's ``PipelineStage``), one rank's
stage -- or, for the multi-stage classes on a plan with virtual stages, its chunks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridpipe.partitioner.plan import load_plan
from hybridpipe.pipeline import MicroBatches, build_stage_index
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model

LR, MOMENTUM, SEED = 0.01, 0.9, 0
# torch's classes that hold several stages per rank, by where they put chunk s of p*V on p ranks
TORCH_LOOPED = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS")
TORCH_V = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


class _TorchStage(torch.nn.Module):
    """hybridpipe's stage graph as torch's PipelineStage takes it (tensors only): the last stage
    returns the model's output as the model does, or a Hugging Face model's logits (torch carries
    no ModelOutput); the others the tuple of what they send."""

    def __init__(self, stage, logits: bool):
        super().__init__()
        self.graph, self.captured, self.last, self.logits = stage.module, stage.captured, stage.is_last, logits

    def forward(self, *args):
        out = self.graph(*args)
        if not self.last:
            return tuple(out)
        output = self.captured.rebuild_output(out)
        return output.logits if self.logits else output


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss: next-token cross-entropy, labels shifted by one."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100)


def torch_side(spec, batch_size: int):
    """(example input, loss_fn, targets from a batch) as a torch.distributed.pipelining user
    writes them: a causal LM that computes its own loss gets its labels as the schedule's target
    (the model returns logits), the rest as the model spec says."""
    example = spec.example_input(batch_size, torch.Generator().manual_seed(SEED))
    if spec.loss is not None:
        return example, spec.loss, lambda x, y: y
    if not (isinstance(example, dict) and "labels" in example and "input_ids" in example):
        raise SystemExit("the torch side of this benchmark supports zoo models and Hugging Face causal LMs")
    return ({k: v for k, v in example.items() if k != "labels"}, causal_lm_loss,
            lambda x, y: x["labels"])


@dataclass
class TorchRun:
    """One rank's torch.distributed.pipelining job, built: ``step(batch(k))`` runs training step
    k (``SCHEDULE.step`` + ``optimizer.step``) as a user of torch's pipelining writes it."""

    schedule: Any
    pipes: list
    optimizer: torch.optim.Optimizer | None
    batch: Callable[[int], tuple[list, dict]]       # step k -> the schedule's (args, kwargs)
    step: Callable[[tuple[list, dict]], None]


def build_theirs(rank: int, plan_path: str, steps: int, kind: str = "Schedule1F1B") -> TorchRun:
    """torch.distributed.pipelining's schedule ``kind`` on the plan's stages, this rank's part."""
    from torch.distributed.pipelining import PipelineStage, schedules

    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    example, loss_fn, target_of = torch_side(spec, plan.batch_size)
    # torch's stages carry tensors only: a static-shape capture (no ints cross the cuts), same blocks
    captured = capture_model(spec.build(), example, granularity=plan.granularity, leaf_modules=spec.leaf_modules,
                             dynamic=False)
    ranges = [(s.first_node, s.last_node) for s in plan.stages]
    mine = [s.index for s in plan.stages_of_rank(rank)[0]]          # several with --virtual-stages
    chunks = [build_stage_index(captured, ranges, s, loss=spec.loss) for s in mine]
    pipes = [PipelineStage(_TorchStage(st, spec.loss is None), st.index, len(ranges), torch.device("cpu"))
             for st in chunks]
    cls = getattr(schedules, kind)
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    schedule = cls(pipes if multi else pipes[0], n_microbatches=plan.micro_batches, loss_fn=loss_fn)
    params = list({id(p): p for st in chunks for p in st.module.parameters()}.values())
    first, last = 0 in mine, len(ranges) - 1 in mine
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM) if params else None
    size = steps * plan.micro_batches * plan.batch_size
    data = MicroBatches(resolve_dataset("synthetic", spec, size=size, seed=SEED), plan.batch_size, plan.micro_batches,
                        targets=spec.loss is not None)

    def batch(k: int) -> tuple[list, dict]:
        x, y = data.global_batch(k)
        args: list = []
        kwargs: dict = {"target": target_of(x, y), "losses": []} if last else {}
        if first:
            # the whole batch, flattened; torch's schedule splits it into micro-batches of the captured shapes
            inputs = captured.flatten_input({k: v for k, v in x.items() if k in example} if isinstance(x, dict) else x,
                                            check=False)
            args = [inputs[name] for name in chunks[0].input_names]
        return args, kwargs

    def step(given: tuple[list, dict]) -> None:
        schedule.step(*given[0], **given[1])
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return TorchRun(schedule, pipes, optimizer, batch, step)


def theirs(rank: int, world: int, plan_path: str, steps: int, kind: str = "Schedule1F1B") -> dict | None:
    """torch.distributed.pipelining's schedule ``kind`` on the same stages; rank 0 returns the job's step times."""
    run = build_theirs(rank, plan_path, steps, kind)
    times = {}
    for k in range(steps):
        t0 = time.perf_counter()
        run.step(run.batch(k))
        times[k] = (time.perf_counter() - t0) * 1e3
    everyone: list = [None] * world
    dist.all_gather_object(everyone, times)
    return {k: max(t[k] for t in everyone) for k in range(steps)} if rank == 0 else None
