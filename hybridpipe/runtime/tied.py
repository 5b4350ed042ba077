"""The process groups and the all-reduce behind pipeline/tied.py's TiedSync in a torchrun job."""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.tied import TiedSync, stage_tied_params, tied_ranks


def tied_process_groups(plan: Plan, timeout_s: float) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One process group per distinct rank set of the plan's tied groups (collective: every rank
    calls it, in the same order, members or not)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return {ranks: dist.new_group(list(ranks), timeout=timeout)
            for ranks in sorted({tied_ranks(plan, g) for g in plan.tied})}


def tied_sync(plan: Plan, stages: int | Iterable[int], model: nn.Module,
              groups: dict[tuple[int, ...], dist.ProcessGroup]) -> TiedSync | None:
    """This rank's TiedSync over its stage (or chunks ``stages``); None when they share no parameter
    with another stage."""
    held = stage_tied_params(plan, stages, model)
    if not held:
        return None

    def summer(group: dist.ProcessGroup):
        def sum_fn(flat: torch.Tensor) -> None:
            dist.all_reduce(flat, group=group)
        return sum_fn

    return TiedSync([(params, summer(groups[ranks])) for ranks, params in held.items()])


def align_tied(plan: Plan, stages: Iterable[int], model: nn.Module,
               groups: dict[tuple[int, ...], dist.ProcessGroup]) -> None:
    """Give every copy of each tied parameter this rank holds the value of the copy of the lowest
    stage's first rank (collective over each tied group's ranks, in the plan's order), as a
    replicated stage's weights are broadcast from its first replica: the copies are one parameter of
    one model, and each rank built its own (an ``nn.Module`` given to the Trainer on every rank,
    built unseeded or loaded differently, held differing copies that the summed gradients never
    brought together)."""
    mine = set(stages)
    for g in plan.tied:
        if mine & set(g.stages):
            p = model.get_parameter(g.param)
            with torch.no_grad():
                dist.broadcast(p.data, src=plan.stages[min(g.stages)].ranks[0], group=groups[tied_ranks(plan, g)])


def repeated_tied(plan: Plan, stages: list[int], module: nn.Module) -> set[int]:
    """ids of the tied parameters this rank's stages hold that are counted on another rank (the
    one of the lowest stage that holds them)."""
    return {id(module.get_parameter(g.param)) for g in plan.tied
            if set(stages) & set(g.stages) and min(g.stages) not in stages}
