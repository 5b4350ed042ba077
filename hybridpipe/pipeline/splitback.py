"""A backward split in two (zero-bubble schedules): input gradients now, weight gradients later.

``backward_input`` computes only the gradients of the stage's inputs (what the previous stage
waits for) and keeps the autograd graph. On the way it records, at every autograd node where a
parameter's gradient path meets the input-gradient path (the "intermediates" of torch's own
``torch.distributed.pipelining._backward``, whose graph walk this reuses), the gradient that
flowed through it. ``backward_weight`` then runs autograd from those recorded gradients to the
parameters only: the weight half is real autograd on the saved graph, not a second backward
from the outputs. Parameters whose gradient path never meets the inputs' (a bias or position
embedding that does not depend on the stage's inputs; every parameter of stage 0, whose inputs
need no gradient) are differentiated from the outputs in the weight half.

Unlike torch's helpers, the weight half accumulates through autograd (``torch.autograd.backward``
with ``inputs=``), so parameters' post-accumulate-grad hooks fire as in a plain backward: the
replicas' per-layer gradient sync (comm/hybrid_dp) starts from them as usual.

The weight half runs one autograd pass per parameter group, each from its own intermediates to
its own parameters: a single pass from every group's intermediates to every parameter would
also run every node on the input-gradient path between two intermediates (autograd executes
whatever leads to a wanted parameter), i.e. most of the backward again (GPT-2, 4 layers: the
split backward cost 1.81x a plain one that way). Under activation recomputation one pass is kept
(``one_pass``): every graph task reruns the checkpointed forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightWork:
    """What the weight half of one micro-batch's backward needs (see the module docstring)."""

    groups: list[dict[str, Any]] = field(default_factory=list)   # params, intermediates, recorded grads
    outputs: list[torch.Tensor] = field(default_factory=list)      # roots for the parameters left over
    output_grads: list[torch.Tensor | None] = field(default_factory=list)
    leftover: list[nn.Parameter] = field(default_factory=list)     # parameters differentiated from the roots
    one_pass: bool = False          # every group in one autograd pass (a recomputing stage; module docstring)


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter], *,
                   one_pass: bool = False) -> WeightWork:
    """Accumulate the gradients of ``inputs`` (leaves) from ``outputs`` (with ``output_grads``;
    None = ones for a scalar loss); return what :func:`backward_weight` needs for ``params``
    (``one_pass``: in a single autograd pass, for a stage that recomputes its forward)."""
    # imported here: torch.distributed.pipelining imports torch._dynamo (seconds of a worker's start)
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
    )

    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    if not outputs:
        return WeightWork(one_pass=one_pass)
    if not wanted:
        return WeightWork(outputs=list(outputs), output_grads=list(output_grads), leftover=params, one_pass=one_pass)
    reverse = construct_reverse_graph(_nodes(outputs))
    acc_of = {_get_grad_fn_or_grad_acc(p): p for p in params}
    groups = get_param_groups(_nodes(wanted), [a for a in acc_of if a is not None], reverse)
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            def record(grad_outputs, group=group, i=i):
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(record))
    try:
        grads = torch.autograd.grad(list(outputs), wanted, list(output_grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(wanted, grads, strict=True):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g
    reached = {id(acc_of[a]) for group in groups if group["intermediates"] for a in group["params"]}
    leftover = [p for p in params if id(p) not in reached]
    kept = [group for group in groups if group["intermediates"]]
    for group in kept:
        group["params"] = [acc_of[a] for a in group["params"]]
    return WeightWork(kept, list(outputs) if leftover else [], list(output_grads) if leftover else [], leftover,
                      one_pass)


def _nodes(tensors: Sequence[torch.Tensor]) -> list[Node]:
    """The autograd nodes that produced ``tensors`` (a leaf's gradient accumulator)."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return [n for n in map(_get_grad_fn_or_grad_acc, tensors) if n is not None]


def backward_weight(work: WeightWork) -> None:
    """Accumulate the parameters' gradients of one micro-batch from :func:`backward_input`'s record
    (through autograd, so gradient hooks fire), and release the graph.

    Each intermediate gets the gradient it received in the input half (a prehook replaces what
    flows into it in a pass: for an intermediate below another, that recorded gradient is
    already whole). One pass per parameter group (see the module docstring), or with
    ``work.one_pass`` one for all: every graph task reruns a checkpointed forward, so one task
    per group would rerun it (and keep what it saved) once per group."""
    handles = []
    passes: list[tuple[list, list, list]] = []       # (edges, grads, parameters) of each autograd pass
    for group in work.groups:
        edges, grads = [], []
        for recorded, node in zip(group["grads"], group["intermediates"], strict=True):
            for i, g in enumerate(recorded or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
            handles.append(node.register_prehook(lambda _grads, saved=recorded: saved))
        passes.append((edges, grads, list(group["params"])))
    if work.leftover:      # the roots too, as edges (a scalar loss's gradient: ones)
        passes.append(([get_gradient_edge(out) for out in work.outputs],
                       [torch.ones_like(out) if g is None else g for out, g in zip(work.outputs, work.output_grads,
                                                                                    strict=True)],
                       list(work.leftover)))
    if work.one_pass and passes:
        passes = [([e for p in passes for e in p[0]], [g for p in passes for g in p[1]],
                   [w for p in passes for w in p[2]])]
    try:
        for edges, grads, params in passes:
            if edges:
                torch.autograd.backward(edges, grads, inputs=params)
    finally:
        for h in handles:
            h.remove()
    work.groups.clear()
    work.outputs.clear()
    work.output_grads.clear()
