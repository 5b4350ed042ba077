"""Which buffers a training forward changes, read from the graph (pure analysis, no forward run).

A buffer changes when an operation writes it in place:

* an op whose schema says it writes an argument (``Tensor(a!)``: ``add_``, ``copy_``,
  ``index_put_``, ``_native_batch_norm_legit``, ...);
* ``aten.batch_norm`` / ``aten.native_batch_norm`` / ``aten.instance_norm`` in training mode,
  which update their running statistics though their schemas do not say so;
* in a torch.fx graph (profiles/trace.py): an in-place method (``buf.add_(1)``), ``out=`` or
  ``operator.setitem`` on a buffer, ``F.batch_norm`` in training mode, a called batch-norm
  module that tracks running statistics.

Writing a view of a buffer (``buf[0].copy_(x)``) writes the buffer. What a leaf module of an fx
graph other than batch norm does inside is not visible here; PipelineStage checks after each
forward of a replicated stage that no buffer changed behind its back (pipeline/stage.py).

Each write is of one kind:

* ``batch_norm``: a batch norm's running mean and variance in training mode (``aten.batch_norm``,
  ``F.batch_norm``, a ``_BatchNorm`` module): a running average of each micro-batch's statistics,
  which replicas can combine exactly (pipeline/batch_stats.py);
* ``counter``: ``buf.add_(c)`` of a constant number to a buffer nothing else reads (BatchNorm's
  ``num_batches_tracked``): the sum of the micro-batches' increments;
* ``other``: anything else, which hybridpipe cannot combine across replicas nor keep from being
  done twice by a recomputed forward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan
from hybridpipe.profiles.capture import CapturedModel
from hybridpipe.profiles.cut import stage_of_nodes

aten = torch.ops.aten

BATCH_NORM, COUNTER, OTHER = "batch_norm", "counter", "other"
COUNTER_OPS = (aten.add_.Tensor, aten.add_.Scalar)
# ops that update running statistics without declaring it: (running_mean, running_var, training) positions
_UNDECLARED = {aten.batch_norm.default: (3, 4, 5), aten.native_batch_norm.default: (3, 4, 5),
               aten.instance_norm.default: (3, 4, 5)}
_FX_VIEWS = {"view", "view_as", "reshape", "narrow", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
             "expand", "expand_as", "flatten", "unflatten", "as_strided", "__getitem__", "chunk", "split", "unbind"}


@dataclass(frozen=True)
class BufferWrite:
    """One operation of a graph that changes a buffer in place."""

    buffer: str             # the buffer's qualified name (the model's)
    node: str               # the fx node that writes it
    op: str                 # the operation, for messages
    kind: str               # BATCH_NORM, COUNTER or OTHER (see the module docstring)


def buffer_writes(gm: fx.GraphModule) -> list[BufferWrite]:
    """Every in-place write of a buffer in ``gm``'s training forward, in graph order."""
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    out: list[BufferWrite] = []
    for node in gm.graph.nodes:
        for name, kind in _writes(gm, node, buffers):
            out.append(BufferWrite(name, node.name, _op_name(node), kind))
    counted = {w.buffer for w in out if w.kind == COUNTER}
    for name in counted:           # a counter somebody reads is no mere count
        if any(_base(gm, n, buffers) == name and not _counts(n, buffers, gm) for n in _readers(gm, name, buffers)):
            out = [BufferWrite(w.buffer, w.node, w.op, OTHER) if w.buffer == name else w for w in out]
    return out


def readers(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Buffer name -> the operations (fx node names) that read or write it (through ``get_attr``
    or as a called module's buffer)."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            for user in node.users:
                out.setdefault(str(node.target), []).append(user.name)
        elif node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            for local, _ in mod.named_buffers(remove_duplicate=False):
                out.setdefault(f"{node.target}.{local}", []).append(node.name)
    return out


def describe(write: BufferWrite) -> str:
    return f"{write.buffer!r} ({write.op})"


def check_stage_writes(writes: list[BufferWrite], index: int, replicas: int, recompute: bool) -> None:
    """UserError for a buffer write a replicated or recomputing stage cannot keep equal to one process."""
    bad = next((w for w in writes if w.kind == OTHER), None)
    if bad is None:
        return
    if replicas > 1:
        raise UserError(f"stage {index} has {replicas} replicas and its training forward changes buffer "
                        f"{describe(bad)}, which hybridpipe cannot combine across replicas (it combines batch-norm "
                        "statistics and counters): give that layer a stage without replicas (re-partition, e.g. "
                        "--strategy uniform --stages WORKERS) or stop changing the buffer in forward")
    if recompute:
        raise UserError(f"stage {index} recomputes its forward and the forward changes buffer {describe(bad)}, which "
                        "would then change twice per micro-batch: re-partition with --recompute none for it")


def check_plan_writes(captured: CapturedModel, plan: Plan) -> None:
    """UserError, before anything runs, for a buffer the plan's stages cannot keep equal to one
    process: one written by one stage and read or written by another (each holds its own copy),
    or a write :func:`check_stage_writes` refuses on a replicated or recomputing stage."""
    writes = buffer_writes(captured.graph)
    if not writes:
        return
    stage_of = stage_of_nodes(captured, [(s.first_node, s.last_node) for s in plan.stages])
    touching = readers(captured.graph)
    for w in writes:
        stages = sorted({stage_of[n] for n in touching.get(w.buffer, []) if n in stage_of})
        if len(stages) > 1:
            raise UserError(f"buffer {w.buffer!r} is changed by the training forward ({w.op}) and used by stages "
                            f"{stages[0]} and {stages[1]}, each of which would keep its own copy: keep the layers "
                            "that use it in one stage (re-partition)")
    for s in plan.stages:
        mine = [w for w in writes if stage_of.get(w.node) == s.index]
        check_stage_writes(mine, s.index, s.replicas, s.recompute)

# ---- helpers ---------------------------------------------------------------------------
def _writes(gm: fx.GraphModule, node: fx.Node, buffers: set[str]) -> list[tuple[str, str]]:
    """(buffer, kind) for every buffer ``node`` writes."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, _BatchNorm) and mod.track_running_stats and mod.running_mean is not None:
            names = [f"{node.target}.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")]
            return [(n, BATCH_NORM) for n in names if n in buffers]
        return []
    if node.op == "call_method":
        method = str(node.target)
        if method.endswith("_") and not method.startswith("__") and node.args:
            base = _base(gm, node.args[0], buffers)
            if base is not None:
                return [(base, COUNTER if _counts(node, buffers, gm) else OTHER)]
        return _out_writes(gm, node, buffers)
    if node.op != "call_function":
        return []
    target = node.target
    if target in _UNDECLARED:
        return _norm_writes(gm, node, buffers, *_UNDECLARED[target],
                            BATCH_NORM if target is aten.batch_norm.default else OTHER)
    if target is torch.nn.functional.batch_norm:
        return _norm_writes(gm, node, buffers, 1, 2, 5, BATCH_NORM)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _subgraph_writes(gm, node, buffers)
    if target is operator.setitem and node.args:
        base = _base(gm, node.args[0], buffers)
        return [(base, OTHER)] if base is not None else []
    schema = getattr(target, "_schema", None)
    if schema is None:
        return _out_writes(gm, node, buffers)
    found = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            base = _base(gm, item, buffers)
            if base is not None:
                found.append((base, COUNTER if _counts(node, buffers, gm) else OTHER))
    return found


def _norm_writes(gm: fx.GraphModule, node: fx.Node, buffers: set[str], mean_at: int, var_at: int, training_at: int,
                 kind: str, keywords: tuple[str, str, str] = ("running_mean", "running_var", "training"),
                 ) -> list[tuple[str, str]]:
    """The running statistics a normalization call updates (none when it is not training; a
    training flag left out is False, as in ``F.batch_norm``)."""
    def arg(i: int, keyword: str, default: Any = None) -> Any:
        return node.args[i] if i < len(node.args) else node.kwargs.get(keyword, default)
    mean, var = arg(mean_at, keywords[0]), arg(var_at, keywords[1])
    training = arg(training_at, keywords[2], False)
    if training is False:
        return []
    stats = [b for b in (_base(gm, mean, buffers), _base(gm, var, buffers)) if b is not None]
    plain = training is True and all(isinstance(v, fx.Node) and v.op == "get_attr" for v in (mean, var))
    return [(b, kind if plain else OTHER) for b in stats]


def _subgraph_writes(gm: fx.GraphModule, node: fx.Node, buffers: set[str]) -> list[tuple[str, str]]:
    """Buffers a higher-order op (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``: a
    ``torch.no_grad()`` or autocast region) writes through its subgraph's inputs: the arguments
    after the subgraph, in order. Always OTHER (nothing inside a subgraph is rewritten)."""
    subs = [(i, getattr(gm, str(a.target))) for i, a in enumerate(node.args) if isinstance(a, fx.Node)
            and a.op == "get_attr" and isinstance(getattr(gm, str(a.target), None), fx.GraphModule)]
    passed = [a for a in node.args if _base(gm, a, buffers) is not None]
    if not subs:
        return [(str(_base(gm, a, buffers)), OTHER) for a in passed]
    sub_at, sub = subs[0]
    inner = list(sub.graph.find_nodes(op="placeholder"))
    outer = list(node.args[sub_at + 1:])
    written = _placeholder_writes(sub)
    if len(inner) != len(outer):
        return [(str(_base(gm, a, buffers)), OTHER) for a in passed] if written else []
    found = []
    for p, a in zip(inner, outer, strict=True):
        base = _base(gm, a, buffers)
        if p.name in written and base is not None:
            found.append((base, OTHER))
    return found


def _placeholder_writes(sub: fx.GraphModule) -> set[str]:
    """Names of the placeholders of ``sub`` that its operations write."""
    inputs = {f"%{n.name}" for n in sub.graph.find_nodes(op="placeholder")}
    return {name[1:] for node in sub.graph.nodes for name, _ in _writes(sub, node, inputs)}


def _out_writes(gm: fx.GraphModule, node: fx.Node, buffers: set[str]) -> list[tuple[str, str]]:
    base = _base(gm, node.kwargs.get("out"), buffers)
    return [(base, OTHER)] if base is not None else []


def _counts(node: fx.Node, buffers: set[str], gm: fx.GraphModule) -> bool:
    """Whether ``node`` is ``buf.add_(c)`` of a constant number on a buffer (or on such an add_'s
    result: the same buffer again), whose result nothing but another such add_ reads."""
    if not _adds_constant(node):
        return False
    root: Any = node
    while _adds_constant(root):
        root = root.args[0]
    if not (isinstance(root, fx.Node) and root.op == "get_attr" and str(root.target) in buffers):
        return False
    chain, seen = [node], 0
    while chain and seen < 10_000:
        seen += 1
        current = chain.pop()
        if not all(_adds_constant(u) for u in current.users):
            return False
        chain += list(current.users)
    return not chain


def _adds_constant(node: Any) -> bool:
    """``x.add_(c)`` (aten or an fx method call) of a constant number ``c``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in COUNTER_OPS:
        plain = bool(node.kwargs.get("alpha", 1) == 1)
    elif node.op == "call_method" and node.target == "add_":
        plain = not node.kwargs
    else:
        return False
    return (plain and len(node.args) == 2 and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool))


def _readers(gm: fx.GraphModule, name: str, buffers: set[str]) -> list[fx.Node]:
    """Nodes that take buffer ``name`` (or a view of it) as an argument."""
    out = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module", "output"):
            if any(_base(gm, a, buffers) == name for a in node.all_input_nodes):
                out.append(node)
    return out


def _base(gm: fx.GraphModule, value: Any, buffers: set[str]) -> str | None:
    """The buffer ``value`` is (or is a view of), else None."""
    seen = 0
    while isinstance(value, fx.Node) and seen < 1000:
        seen += 1
        if value.op == "get_attr":
            name = str(value.target)
            return name if name in buffers else None
        if value.op == "placeholder":            # a subgraph's input (see _placeholder_writes)
            return f"%{value.name}" if f"%{value.name}" in buffers else None
        if value.op == "call_method" and str(value.target) in _FX_VIEWS and value.args:
            value = value.args[0]
        elif value.op == "call_function" and value.target is operator.getitem and value.args:
            value = value.args[0]
        elif value.op == "call_function" and _aliases_first(value.target):
            value = value.args[0] if value.args else None
        else:
            return None
    return None


def _aliases_first(target: Any) -> bool:
    """An op whose output is (a view of) its first argument: a view, or an in-place op's result."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and ret is not None and bool(set(first.before_set) & set(ret.before_set))


def _op_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"a {type(node.graph.owning_module.get_submodule(str(node.target))).__name__} module" \
            if node.graph.owning_module is not None else str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    return str(getattr(node.target, "__name__", node.target))
