"""Tracing a model into a torch.fx graph: the one graph that profiling and stage building share.

``trace_model`` must be deterministic: the profiler records its nodes (names, order, owned
parameters) and the pipeline later re-traces the same model and cuts the same graph, so a
plan's node ranges mean the same nodes on every rank. Node id = position in ``gm.graph.nodes``
(= index in ``node_infos(gm)``); ``graph_edges(gm)`` gives the edges in those ids.

A model fx cannot trace (data-dependent control flow, iterating a tensor, ...) is refused with a
``UserError`` naming the module and source line, unless it is an ``nn.Sequential``: then each of
its children becomes one leaf node (the sequential fallback), which needs no tracing inside them.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import networkx as nx
import torch
from torch import fx, nn

from hybridpipe.errors import UserError

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)


class _LeafTracer(fx.Tracer):
    """fx's default tracer (torch.nn modules are leaves) plus user-chosen leaves.

    Leaves are module types, class names, or (for the sequential fallback) qualified names.
    It remembers the stack of modules being traced when tracing fails, to name the culprit.
    """

    def __init__(self, leaf_types: tuple[type, ...] = (), leaf_names: frozenset[str] = frozenset(),
                 leaf_paths: frozenset[str] = frozenset()):
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names
        self.leaf_paths = leaf_paths
        self.stack: list[tuple[str, str]] = []
        self.failed_in: list[tuple[str, str]] | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, self.leaf_types) or bool(_class_names(type(m)) & self.leaf_names)
                or qualname in self.leaf_paths or super().is_leaf_module(m, qualname))

    def call_module(self, m: nn.Module, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = list(self.stack)
            raise
        finally:
            self.stack.pop()


def trace_model(model: nn.Module, leaf_modules: Iterable[type | str] = ()) -> fx.GraphModule:
    """Symbolically trace ``model`` into a GraphModule (deterministic node order).

    ``leaf_modules`` are module types or class names (``"Gate"`` or ``"pkg.mod.Gate"``) kept as
    single nodes. Raises ``UserError`` for an unknown leaf name or an untraceable model.
    """
    types, names = _leaf_spec(model, leaf_modules)
    tracer = _LeafTracer(types, names)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # fx raises TraceError, RuntimeError, TypeError, ... from user code
        if isinstance(model, nn.Sequential) and len(model) > 0:
            log.warning("torch.fx cannot trace %s (%s: %s); profiling it child by child, each child one node",
                        type(model).__name__, type(e).__name__, _first_line(e))
            tracer = _LeafTracer(types, names, frozenset(name for name, _ in model.named_children()))
            graph = tracer.trace(model)
        else:
            raise UserError(untraceable_message(model, tracer.failed_in or [], e)) from None
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


def untraceable_message(model: nn.Module, failed_in: list[tuple[str, str]], error: BaseException) -> str:
    """One line: which module and source line fx could not trace, and how to get around it."""
    where = f"in module '{failed_in[-1][0]}' ({failed_in[-1][1]})" if failed_in else \
        f"in {type(model).__name__}.forward"
    frame = _user_frame(error)
    at = f" at {os.path.basename(frame.filename)}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
    fix = (f"mark it as a leaf so it is profiled as one node: --leaf {failed_in[-1][1]} (or "
           f"leaf_modules=({failed_in[-1][1]},) in the ModelSpec, or the model spec suffix [leaf={failed_in[-1][1]}])"
           if failed_in else
           "move that code into a submodule and mark the submodule as a leaf (--leaf ClassName), "
           "or build the model as an nn.Sequential of parts, which is profiled part by part")
    return (f"torch.fx cannot trace {type(model).__name__} {where}{at}: {type(error).__name__}: "
            f"{_first_line(error)}; {fix}")


def _user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is not torch's tracing machinery."""
    frames = traceback.extract_tb(error.__traceback__)
    def machinery(f: traceback.FrameSummary) -> bool:
        return f.filename == __file__ or (f.filename.startswith(_TORCH_DIR) and
                                          not (os.sep + os.path.join("nn", "modules") + os.sep in f.filename
                                               and not f.filename.endswith("module.py")))
    user = [f for f in frames if not machinery(f)]
    return user[-1] if user else None


def _first_line(error: BaseException) -> str:
    """The error's first sentence (fx's messages go on for a paragraph)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else "(no message)"
    return line.split(". ")[0] if len(line) > 120 else line


def _class_names(cls: type) -> set[str]:
    return {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}


def _leaf_spec(model: nn.Module, leaf_modules: Iterable[type | str]) -> tuple[tuple[type, ...], frozenset[str]]:
    """Split leaves into types and class names; every name must match a module class in ``model``."""
    types = tuple(x for x in leaf_modules if isinstance(x, type))
    names = frozenset(x for x in leaf_modules if isinstance(x, str))
    bad = [x for x in leaf_modules if not isinstance(x, (type, str))]
    if bad:
        raise UserError(f"leaf modules must be module classes or class names, got {bad[0]!r}")
    present: set[str] = set()
    for m in model.modules():
        present |= _class_names(type(m))
    unknown = sorted(names - present)
    if unknown:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise UserError(f"leaf module {unknown[0]!r} is not a module class of {type(model).__name__}; "
                        f"its classes are: {', '.join(classes)}")
    return types, names


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


def graph_edges(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """Data edges ``(src_id, dst_id)`` between node ids (positions in graph order), sorted.

    One edge per (producer, consumer) pair however often the consumer reads the value; this is
    the edge list every profile holds and every consumer of a profile relies on.
    """
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return sorted({(index[src], index[node]) for node in gm.graph.nodes for src in node.all_input_nodes})


def to_digraph(gm: fx.GraphModule) -> nx.DiGraph:
    """The traced graph as a networkx DiGraph: node ids as keys, NodeInfo fields as attributes."""
    g = nx.DiGraph()
    for i, info in enumerate(node_infos(gm)):
        g.add_node(i, **asdict(info))
    g.add_edges_from(graph_edges(gm))
    return g


def attr_target(node: fx.Node) -> str:
    """The qualified name a ``call_module`` or ``get_attr`` node refers to."""
    if not isinstance(node.target, str):
        raise TypeError(f"{node.op} node {node.name} has target {node.target!r}, not a qualified name")
    return node.target


def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    if node.op == "call_module":
        target = attr_target(node)
        return [f"{target}.{name}" for name, _ in gm.get_submodule(target).named_parameters()]
    if node.op == "get_attr":
        target = attr_target(node)
        obj = _get_attr(gm, target)
        if isinstance(obj, nn.Parameter):
            return [target]
        if isinstance(obj, nn.Module):
            return [f"{target}.{name}" for name, _ in obj.named_parameters()]
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
        return type(gm.get_submodule(attr_target(node))).__name__
    if node.op in ("call_function", "call_method"):
        t = node.target
        return t if isinstance(t, str) else getattr(t, "__name__", str(t))
    if node.op == "get_attr":
        obj = _get_attr(gm, attr_target(node))
        return "Parameter" if isinstance(obj, nn.Parameter) else type(obj).__name__
    return node.op


__all__ = ["trace_model", "node_infos", "NodeInfo", "graph_edges", "to_digraph", "untraceable_message"]
