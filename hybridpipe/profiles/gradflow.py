"""Which values of a captured graph can carry a gradient (a dataflow over the graph, no run).

A value can require grad only if it is computed from a trainable parameter (or from a module
that holds one: a leaf module, a subgraph); the model's inputs, buffers (rotary ``inv_freq``,
batch norm's statistics) and constants cannot. So the cosines and sines of rotary position
embeddings, an attention mask or position ids, computed from inputs and buffers alone, need no
gradient when they cross into a later stage: the stage receiving them would otherwise make them
leaves that require grad, keep extra tensors for their backward (q and k beside cos and sin in
every Llama layer), compute their gradients and send them back for nothing.

The answer over-approximates autograd's (an op that is not differentiable, or runs under
``no_grad``, still propagates here), which is safe: a value marked here merely keeps today's
behaviour. An in-place operation can make a value require grad after it was computed (``x[i] =
w``, ``copy_``): where one writes data that may carry a gradient into anything but a buffer,
:func:`grad_values` answers None, and the caller treats every floating-point value as possibly
requiring grad.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn


def grad_values(graph: fx.GraphModule) -> set[str] | None:
    """Names of the nodes of ``graph`` whose value may require grad (None: an in-place write of
    such a value makes the analysis unsafe; treat every value as possibly requiring grad)."""
    marked: set[str] = set()
    for node in graph.graph.nodes:
        inputs = [n.name for n in node.all_input_nodes]
        if node.op == "get_attr":
            carries = _attr_carries(graph, str(node.target))
        elif node.op == "call_module":
            carries = _module_carries(graph.get_submodule(str(node.target))) or any(n in marked for n in inputs)
        elif node.op in ("call_function", "call_method"):
            carries = any(n in marked for n in inputs)
            if carries and _mutates(node):
                return None
        else:                                   # placeholders (the model's inputs), the output
            carries = False
        if carries:
            marked.add(node.name)
    return marked


def _attr_carries(graph: fx.GraphModule, target: str) -> bool:
    obj: object = graph
    for part in target.split("."):
        obj = getattr(obj, part, None)
    if isinstance(obj, torch.Tensor):
        return bool(obj.requires_grad)
    if isinstance(obj, nn.Module):
        return _module_carries(obj)
    return obj is not None and not isinstance(obj, (int, float, bool, str))


def _module_carries(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into one of its inputs in place (aten ``foo_``, ``x.foo_()``, ``x[i] = v``)."""
    target = node.target
    if node.op == "call_method":
        return str(target).endswith("_") and not str(target).startswith("_")
    if target is operator.setitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None:            # an aten op: the arguments it writes, but buffers (batch norm's statistics)
        written = [node.kwargs.get(a.name) if k >= len(node.args) else node.args[k]
                   for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        return any(not (isinstance(w, fx.Node) and w.op == "get_attr") for w in written)
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")
