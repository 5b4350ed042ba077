"""The evaluation-mode twin of a captured (training-mode) graph.

torch.export captures a model in training mode: dropout is an ``aten.dropout(x, p, train=True)``
call, batch norm an ``aten.batch_norm(..., training=True, ...)`` call, and attention's dropout
probability a constant argument -- ``model.eval()`` cannot reach them any more. ``eval_graph``
returns a copy of a graph module (same parameters and buffers, the same objects) whose calls are
their evaluation forms: no dropout (in place or not), batch and instance norm on their running
statistics where they keep them (which they then no longer update, ``num_batches_tracked``
included), RReLU at its mean slope; the bodies of higher-order calls (an ``autocast(enabled=False)``
region's ``wrap_with_autocast``) alike. A Python branch on ``self.training`` in the model's code is
not in the graph any more: the training branch is what was captured, and evaluation runs it too
(README, ``eval_step``). Graphs from torch.fx's tracer call modules, whose own ``eval()`` does this, so the copy
calls evaluation-mode twins of them: shallow copies that share their parameters, buffers and
submodules' tensors but not their ``training`` flag (the training graph's modules stay in
training mode).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import fx, nn

aten = torch.ops.aten

# op -> (position of the flag in args, the flag's keyword, its evaluation value); the in-place dropouts
# are what nn.Dropout(inplace=True) and F.dropout(..., inplace=True) export to, rrelu samples its slope
# in training and uses the mean slope in evaluation
_FLAGS: dict[Any, tuple[int, str, Any]] = {
    aten.dropout.default: (2, "train", False),
    aten.dropout_.default: (2, "train", False),
    aten.feature_dropout.default: (2, "train", False),
    aten.feature_dropout_.default: (2, "train", False),
    aten.alpha_dropout.default: (2, "train", False),
    aten.alpha_dropout_.default: (2, "train", False),
    aten.feature_alpha_dropout.default: (2, "train", False),
    aten.feature_alpha_dropout_.default: (2, "train", False),
    aten.rrelu.default: (3, "training", False),
    aten.rrelu_with_noise.default: (4, "training", False),
    aten.batch_norm.default: (5, "training", False),
    aten.instance_norm.default: (5, "use_input_stats", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
}
# normalisations that use their running statistics in evaluation only where they keep them
# (track_running_stats=False: no running_mean, batch statistics in both modes, as eval() computes)
_RUNNING_MEAN: dict[Any, int] = {aten.batch_norm.default: 3, aten.instance_norm.default: 3}


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` computing the model in evaluation mode (see the module docstring)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if _counts_batches(node):            # BatchNorm's num_batches_tracked += 1: training only
            env[node] = env[node.args[0]]    # add_ returns its input
            continue
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target in _FLAGS and _keeps_statistics(node):
            index, keyword, value = _FLAGS[node.target]
            if keyword in new.kwargs:
                new.kwargs = {**new.kwargs, keyword: value}
            elif len(new.args) > index:
                new.args = (*new.args[:index], value, *new.args[index + 1:])
            elif keyword != "dropout_p":       # absent: the default (no dropout) already
                new.kwargs = {**new.kwargs, keyword: value}
        env[node] = new
    out = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Eval")
    for node in graph.nodes:
        if node.op == "call_module":
            out.set_submodule(str(node.target), _eval_twin(gm.get_submodule(str(node.target))))
        elif node.op == "get_attr" and isinstance(sub := _attr(gm, str(node.target)), fx.GraphModule):
            # a higher-order op's body (torch.autocast(enabled=False) regions: wrap_with_autocast)
            out.set_submodule(str(node.target), eval_graph(sub))
    out.eval()
    return out


def _attr(gm: fx.GraphModule, target: str) -> object:
    """The attribute a get_attr node reads (None where there is none)."""
    owner: object = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _counts_batches(node: fx.Node) -> bool:
    """Whether ``node`` is a BatchNorm's ``num_batches_tracked.add_(1)`` (torch's ``_BatchNorm.forward``
    runs it under ``if self.training``, so a training capture holds it and evaluation must not)."""
    if node.op != "call_function" or node.target is not aten.add_.Tensor or len(node.args) != 2 or node.args[1] != 1:
        return False
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.long or val.dim() != 0:
        return False
    stack = node.meta.get("nn_module_stack") or {}
    return bool(stack) and _is_batch_norm(list(stack.values())[-1][1])


def _is_batch_norm(kind: object) -> bool:
    """Whether a module type (or its qualified name, as nn_module_stack records it) is a BatchNorm
    (only modules already imported are looked up)."""
    if isinstance(kind, str):
        module, _, name = kind.rpartition(".")
        kind = getattr(sys.modules.get(module), name, None)
    return isinstance(kind, type) and issubclass(kind, nn.modules.batchnorm._BatchNorm)


def _keeps_statistics(node: fx.Node) -> bool:
    """False for a normalisation without running statistics (it normalises by the batch in evaluation
    too); True for every other flagged call."""
    index = _RUNNING_MEAN.get(node.target)
    if index is None:
        return True
    value = node.args[index] if len(node.args) > index else node.kwargs.get("running_mean")
    return value is not None


def _eval_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` and its submodules (the same parameter and buffer tensors) in
    evaluation mode, leaving ``module`` as it is."""
    twin = copy.copy(module)
    twin.__dict__["_parameters"] = dict(module._parameters)
    twin.__dict__["_buffers"] = dict(module._buffers)
    twin.__dict__["_modules"] = {k: _eval_twin(m) if m is not None else None for k, m in module._modules.items()}
    twin.training = False
    return twin
