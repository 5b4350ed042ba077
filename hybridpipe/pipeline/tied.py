"""Tied weights across stages: the copies' gradients summed every step, so the copies stay identical.

A parameter read by several stages (GPT-2's ``wte`` = ``lm_head``: the plan's ``tied`` groups)
lives on every rank of those stages, once per rank: two model chunks of one rank (virtual stages,
e.g. zbv's first and last stage) share the model's Parameter object, so its gradient accumulates
both chunks' parts before the sum, which counts each rank once. The replicas of a stage do not
sync it (their gradient sync leaves it out); instead, right before the optimizer step, every rank
of those stages contributes its own accumulated gradient to one sum over all of them. Every copy
then holds the gradient of the whole model's parameter, the same bits on every rank, and
identical optimizer steps keep the copies bit-identical. How the sum is done is the caller's
(torch.distributed's all-reduce over a group of those ranks in a job, runtime/tied.py; a thread
barrier in tests, inprocess.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan, TiedGroup

SumFn = Callable[[torch.Tensor], None]      # sums a flat tensor in place across the copies' ranks


def tied_ranks(plan: Plan, group: TiedGroup) -> tuple[int, ...]:
    """Every rank that holds a copy of ``group``'s parameter, once (with virtual stages two stages
    of one rank may read it: the rank's chunks share one copy)."""
    return tuple(sorted({r for s in group.stages for r in plan.stages[s].ranks}))


def stage_tied_params(plan: Plan, stages: int | Iterable[int], model: nn.Module
                      ) -> dict[tuple[int, ...], list[nn.Parameter]]:
    """The tied parameters a rank's stage (or its chunks ``stages``) holds (objects of ``model``,
    each once), by the ranks that share them."""
    mine = {stages} if isinstance(stages, int) else set(stages)
    out: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for g in plan.tied:
        if mine & set(g.stages):
            try:
                p = model.get_parameter(g.param)
            except AttributeError:
                raise UserError(f"the plan ties parameter {g.param!r}, which the model does not have; "
                                "re-profile and re-partition") from None
            out.setdefault(tied_ranks(plan, g), []).append(p)
    return dict(sorted(out.items()))


class TiedSync:
    """``reduce()`` sums this rank's tied gradients with the other copies' (see the module docstring)."""

    def __init__(self, buckets: Sequence[tuple[list[nn.Parameter], SumFn]]):
        self.buckets = list(buckets)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for params, _ in self.buckets for p in params]

    def reduce(self) -> None:
        """Sum the gradients of every tied parameter this rank holds, in place (a missing one is zeros)."""
        for params, sum_fn in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            with torch.no_grad():
                sum_fn(flat)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
                offset += g.numel()


def complete_tied(state: dict[str, torch.Tensor], aliases: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
    """``state`` (merged from stages) with every name of a tied parameter present, as the unsplit
    model's ``state_dict`` has them; the copies the stages held must be bit-identical."""
    out = dict(state)
    for names in aliases:
        held = [n for n in names if n in out]
        if not held:
            continue
        first = out[held[0]]
        for n in held[1:]:
            if not torch.equal(out[n], first):
                diff = float((out[n].double() - first.double()).abs().max())
                raise UserError(f"the stages' copies of tied parameter {names[0]!r} differ ({held[0]} vs {n}: "
                                f"max |difference| {diff:.3g}); the checkpoint was not trained with tied "
                                "gradients summed across stages, and cannot be merged into one model")
        for n in names:
            out[n] = first
    return out
