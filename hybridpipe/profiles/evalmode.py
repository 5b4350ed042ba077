"""The evaluation-mode twin of a captured (training-mode) graph.

torch.export captures a model in training mode: dropout is an ``aten.dropout(x, p, train=True)``
call, batch norm an ``aten.batch_norm(..., training=True, ...)`` call, and attention's dropout
probability a constant argument -- ``model.eval()`` cannot reach them any more. ``eval_graph``
returns a copy of a graph module (same parameters and buffers, the same objects) whose calls are
their evaluation forms: no dropout, batch norm on its running statistics (which it then no longer
updates). Graphs from torch.fx's tracer call modules, whose own ``eval()`` does this, so for them
the copy also has its modules switched to eval mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

# op -> (position of the flag in args, the flag's keyword, its evaluation value)
_FLAGS: dict[Any, tuple[int, str, Any]] = {
    aten.dropout.default: (2, "train", False),
    aten.feature_dropout.default: (2, "train", False),
    aten.alpha_dropout.default: (2, "train", False),
    aten.feature_alpha_dropout.default: (2, "train", False),
    aten.batch_norm.default: (5, "training", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
}


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` computing the model in evaluation mode (see the module docstring)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target in _FLAGS:
            index, keyword, value = _FLAGS[node.target]
            if keyword in new.kwargs:
                new.kwargs = {**new.kwargs, keyword: value}
            elif len(new.args) > index:
                new.args = (*new.args[:index], value, *new.args[index + 1:])
            elif keyword != "dropout_p":       # absent: the default (no dropout) already
                new.kwargs = {**new.kwargs, keyword: value}
        env[node] = new
    out = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Eval")
    out.eval()
    return out
