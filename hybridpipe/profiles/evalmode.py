"""The evaluation-mode twin of a captured (training-mode) graph.

torch.export captures a model in training mode: dropout is an ``aten.dropout(x, p, train=True)``
call, batch norm an ``aten.batch_norm(..., training=True, ...)`` call, and attention's dropout
probability a constant argument -- ``model.eval()`` cannot reach them any more. ``eval_graph``
returns a copy of a graph module (same parameters and buffers, the same objects) whose calls are
their evaluation forms: no dropout (in place or not), batch and instance norm on their running
statistics where they keep them (which they then no longer update), RReLU at its mean slope. A
Python branch on ``self.training`` in the model's code is not in the graph any more: the training
branch is what was captured, and evaluation runs it too (README, ``eval_step``). Graphs from torch.fx's tracer call modules, whose own ``eval()`` does this, so the copy
calls evaluation-mode twins of them: shallow copies that share their parameters, buffers and
submodules' tensors but not their ``training`` flag (the training graph's modules stay in
training mode).
"""

from __future__ import annotations

import copy
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
_RUNNING_MEAN = {aten.batch_norm.default: 3, aten.instance_norm.default: 3}


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` computing the model in evaluation mode (see the module docstring)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
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
    out.eval()
    return out


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
