"""A rank that holds several model chunks (virtual stages): one module over them.

Under interleaved 1F1B and zbv a rank runs V stages of the plan (``Topology.stages_of(rank)``), each
a :class:`~hybridpipe.pipeline.stage.PipelineStage` with its own graph module. What is per rank
rather than per chunk -- the optimizer, the checkpoint, the weights' digest, the memory meter --
works on :func:`rank_module`: one ``nn.Module`` holding every chunk's parameters and buffers under
the model's own names, each object once. A weight two chunks of one rank read (GPT's ``wte`` =
``lm_head`` under zbv, whose first and last stages share a rank) is one Parameter of the model in
both chunks: its gradient accumulates from both, and the optimizer sees it once.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan


def rank_module(modules: Sequence[nn.Module]) -> nn.Module:
    """One module over the chunks' ``modules``: their parameters and buffers under their own
    (the model's) names, an object shared by two chunks once; ``state_dict()`` is the union of
    the chunks' (non-persistent buffers stay out). A single module is returned as it is."""
    if len(modules) == 1:
        return modules[0]
    root = nn.Module()
    for module in modules:
        persistent = set(module.state_dict())
        for name, p in module.named_parameters():
            _put(root, name, p, None)
        for name, b in module.named_buffers():
            _put(root, name, b, name in persistent)
    return root


def _put(root: nn.Module, name: str, tensor, persistent: bool | None) -> None:
    """Register ``tensor`` at dotted ``name`` under ``root`` (a parameter when ``persistent`` is None)."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    held = owner._parameters.get(leaf) if persistent is None else owner._buffers.get(leaf)
    if held is not None:
        if held is not tensor:
            raise ValueError(f"two chunks of one rank hold different tensors named {name!r}")
        return
    if persistent is None:
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)


def check_rank_memory(plan: Plan) -> None:
    """Refuse (one line) a plan with virtual stages whose rank group holds chunks predicted to need,
    together, more memory per worker than the plan's cluster has (each chunk's ``memory_bytes``
    alone is checked by ``partitioner.plan.check_plan_memory``)."""
    budget = plan.cluster.memory_gb * 1e9
    held: dict[tuple[int, ...], list[int]] = {}
    for s in plan.stages:
        held.setdefault(tuple(s.ranks), []).append(s.index)
    for ranks, stages in held.items():
        need = sum(plan.stages[i].memory_bytes for i in stages)
        if len(stages) > 1 and need > budget:
            raise UserError(f"ranks {list(ranks)} hold stages {','.join(map(str, stages))}, predicted to need "
                            f"{need / 1e9:.2f} GB per worker together, more than the plan's "
                            f"{plan.cluster.memory_gb:g} GB; re-partition (--recompute auto, fewer --virtual-stages, "
                            "more workers or fewer --micro-batches) or give the cluster more memory_gb")
