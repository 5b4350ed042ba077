"""Tracing a model into a torch.fx graph: the one graph that profiling and stage building share.

``trace_model`` must be deterministic: the profiler records its nodes (names, order, owned
parameters) and the pipeline later re-traces the same model and cuts the same graph, so a
plan's node ranges mean the same nodes on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn


class _LeafTracer(fx.Tracer):
    """fx's default tracer (torch.nn modules are leaves) plus user-chosen leaf module types."""

    def __init__(self, leaf_modules: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = tuple(leaf_modules)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, qualname)


def trace_model(model: nn.Module, leaf_modules: tuple[type, ...] = ()) -> fx.GraphModule:
    """Symbolically trace ``model``; module types in ``leaf_modules`` stay single nodes."""
    tracer = _LeafTracer(leaf_modules)
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


@dataclass(frozen=True)
class NodeInfo:
    """What the profile records of a node's identity (no costs)."""

    name: str
    op: str
    target: str
    type: str
    params: tuple[str, ...]
    inputs: tuple[str, ...]       # names of the nodes it reads


def node_infos(gm: fx.GraphModule) -> list[NodeInfo]:
    """Identity of every node in graph order; each parameter is owned by the first node using it."""
    owned: set[str] = set()
    infos = []
    for node in gm.graph.nodes:
        params = tuple(p for p in _node_params(gm, node) if p not in owned)
        owned.update(params)
        infos.append(NodeInfo(name=node.name, op=node.op, target=_target_name(node),
                              type=_type_name(gm, node), params=params,
                              inputs=tuple(n.name for n in node.all_input_nodes)))
    return infos


def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return [f"{node.target}.{name}" for name, _ in mod.named_parameters()]
    if node.op == "get_attr":
        obj = _get_attr(gm, node.target)
        if isinstance(obj, nn.Parameter):
            return [node.target]
        if isinstance(obj, nn.Module):
            return [f"{node.target}.{name}" for name, _ in obj.named_parameters()]
    return []


def _get_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def _type_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op in ("call_function", "call_method"):
        t = node.target
        return t if isinstance(t, str) else getattr(t, "__name__", str(t))
    if node.op == "get_attr":
        obj = _get_attr(gm, node.target)
        return "Parameter" if isinstance(obj, nn.Parameter) else type(obj).__name__
    return node.op


__all__ = ["trace_model", "node_infos", "NodeInfo"]
