"""Capturing a model into the one graph that profiling, partitioning and stage building share.

``capture_model(model, example)`` runs ``torch.export.export(..., strict=False)`` on the model in
training mode, with every input dimension dynamic where the model allows it (so a batch of
another size or sequence length runs through the same graph), and groups the graph's operations
into blocks (blocks.py). The graph's parameters and buffers are the model's own objects under
their ``state_dict`` names. If torch.export cannot capture the model, torch.fx's symbolic tracer
is tried (profiles/trace.py), with the ``leaf_modules`` as single calls that run as written; if
both fail, the user gets one line naming the construct, the source line and what to do.

Leaf modules (``--leaf CLASS``) are exported as one opaque call each that runs the module as
written, eagerly, with its own autograd (profiles/leaves.py): data-dependent routing, ``.item()``,
loops over experts, custom autograd Functions all run inside a leaf.

A custom ``torch.autograd.Function`` outside the leaves is a case of its own: torch.export records
the operations of its ``forward`` and differentiates those, so its own ``backward`` would silently
be lost (a gradient reversal layer would train the wrong way). Such a model is refused with one
line naming the module whose forward calls the Function, to be kept whole with ``--leaf``. (An
operator registered with ``torch.library`` and its autograd formula is exported as one call, its
backward kept.)

The example input is what one batch of the dataset holds, passed as profiles/calling.py says
(a tensor, a tuple or list, a dict; ``use_cache=False`` where the forward takes it). The result is
a ``CapturedModel`` (profiles/captured.py).

The capture must be deterministic: every rank captures the same model the same way, and the
profile's block ids and names mean the same blocks on every rank.

Mixed precision (``autocast=torch.bfloat16`` / ``float16``): the model is captured under
``torch.autocast`` of its device and the graph runs under the same autocast. torch.export records
ATen calls above the autocast dispatch key (``linear``, ``softmax`` as the model called them, no
casts), so at run time autocast applies exactly eager autocast's casts and kernels. What the trace
fixes is what the model's Python read from dtypes (``x.to(h.dtype)``, ``torch.finfo(h.dtype)``,
``if h.dtype == torch.float16``): under autocast it reads eager autocast's 16-bit dtypes, and the
model's own upcasts (RMSNorm in float32) are in the graph as the ``to`` calls they are. torch.export
guards every ``to`` with ``_assert_tensor_metadata`` on the dtype it traced: a float32 capture run
under autocast fails there ("Tensor dtype mismatch"); an autocast capture keeps them as a check.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.blocks import check_leaf_modules, group_blocks, is_operation, parse_granularity
from hybridpipe.profiles.calling import autocast_context, call_args, own_loss, training_switches
from hybridpipe.profiles.captured import CapturedModel, graph_attr, node_parameters, tied_parameters, unsendable
from hybridpipe.profiles.export_support import (
    custom_functions,
    export_failure_message,
    first_line,
    function_refusal,
    quiet_failures,
    side_effect_free,
)
from hybridpipe.profiles.host_random import host_draws
from hybridpipe.profiles.input_shapes import input_shapes
from hybridpipe.profiles.leaves import inline_leaves, leaf_paths, opaque_leaves, record_calls

log = logging.getLogger(__name__)
GUARDS = "_guards_fn"       # the submodule of ExportedProgram.module() that checks its inputs' shapes


def capture_model(model: nn.Module, example: Any, *, granularity: str | int = "blocks",
                  leaf_modules: Iterable[type | str] = (), dynamic: bool = True,
                  autocast: torch.dtype | None = None) -> CapturedModel:
    """Capture ``model`` (in training mode) on ``example`` and group it into blocks.

    ``dynamic=False`` fixes every shape to the example's (no ints cross cuts then: a graph for
    runtimes that carry tensors only, such as torch.distributed.pipelining's stages).
    ``autocast`` (``torch.bfloat16`` / ``torch.float16``): capture under ``torch.autocast`` to it,
    for a graph that runs under it (see the module docstring); None: float32 as the model is."""
    model.train()
    parse_granularity(granularity)          # refuse a bad granularity or leaf name before the slow export
    leaf_modules = tuple(leaf_modules)
    check_leaf_modules(model, leaf_modules)
    _refuse_checkpointing(model)
    with autocast_context(model, autocast):
        captured = _capture(model, example, granularity, leaf_modules, dynamic)
    captured.autocast = autocast
    return captured


def _refuse_checkpointing(model: nn.Module) -> None:
    """UserError (one line) for a model with transformers' gradient checkpointing on
    (``gradient_checkpointing_enable()``, ``gradient_checkpointing=true`` in its config): the exported
    graph holds each layer's forward once and saves its activations as without it, so the memory
    it promises would silently not be saved; hybridpipe recomputes per stage instead."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise UserError(f"{type(model).__name__} has gradient checkpointing on, which the captured graph cannot keep "
                        "(each layer would run once and keep its activations); turn it off "
                        "(gradient_checkpointing_disable(), no gradient_checkpointing=true) and use hybridpipe's "
                        "recomputation: partition --recompute all (or auto: only the stages that need it)")


def _capture(model: nn.Module, example: Any, granularity: str | int, leaf_modules: tuple[type | str, ...],
             dynamic: bool) -> CapturedModel:
    args, kwargs = call_args(example)
    kwargs = {**kwargs, **training_switches(model)}
    functions: list[str] = []
    try:
        captured = _export(model, args, kwargs, functions, dynamic, leaf_modules)
    except UserError:
        raise
    except Exception as export_error:  # torch.export raises many kinds; the fx tracer may still succeed
        captured = _fx_fallback(model, args, kwargs, export_error, leaf_modules)
        with side_effect_free(model), torch.enable_grad():   # export stopped short of seeing them all
            functions = custom_functions(model(*args, **kwargs))
    if functions:
        captured = _keeping_functions(model, args, kwargs, functions, leaf_modules, captured)
    _canonical_names(captured.graph, model)
    blocks = group_blocks(captured.graph, model, granularity, leaf_modules)
    captured.blocks = tuple(blocks)
    captured.blocked = _unsendable_values(captured)
    return captured


def _export(model: nn.Module, args: tuple, kwargs: dict, functions: list[str], dynamic_shapes_wanted: bool = True,
            leaf_modules: tuple[type | str, ...] = ()) -> CapturedModel:
    """torch.export's graph of ``model``, each leaf module one call of the module itself; the custom
    autograd Functions its forward calls outside the leaves are added to ``functions`` (seen on the
    autograd graph of the traced output, which export records)."""
    from torch.export import Dim, export
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def dynamic(x: Any) -> Any:
        return {i: Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None

    def seen(module: nn.Module, inputs: Any, output: Any) -> None:
        functions.extend(f for f in custom_functions(output) if f not in functions)

    paths = leaf_paths(model, leaf_modules)
    calls = record_calls(model, paths, args, kwargs) if paths else {}
    hook = model.register_forward_hook(seen)
    try:
        try:
            if not dynamic_shapes_wanted:
                raise ValueError("static shapes asked for")
            bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
            dynamic_shapes: Any = {name: pytree.tree_map(dynamic, value) for name, value in bound.items()}
            with quiet_failures(), opaque_leaves(model, calls), host_draws() as drawn:
                ep = export(model, *_unmarked(args, kwargs), strict=False, dynamic_shapes=dynamic_shapes)
        except Exception as e:
            if isinstance(e, GuardOnDataDependentSymNode):
                raise                    # a branch on tensor values: static shapes cannot help
            functions.clear()
            with quiet_failures(), opaque_leaves(model, calls), host_draws() as drawn:   # fresh tensors
                ep = export(model, *_unmarked(args, kwargs), strict=False)
            if dynamic_shapes_wanted:
                log.info("captured %s with static shapes: every batch must have the example's shapes "
                         "(dynamic shapes failed: %s: %s)", type(model).__name__, type(e).__name__, first_line(e))
    finally:
        hook.remove()
    if drawn:
        raise UserError(f"{type(model).__name__}'s forward draws host random numbers ({drawn[0]}): the captured graph "
                        "would replay the capture's draw at every step instead of drawing anew; turn that randomness "
                        "off (e.g. Wav2Vec2's mask_time_prob=0) or keep the module that draws whole: --leaf CLASS")
    gm = ep.module()
    guards = getattr(gm, GUARDS, None)      # export's checks of the input shapes: kept, called by flatten_input
    if calls:
        inline_leaves(gm, model, calls)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and not is_operation(node) and not node.users:
            gm.graph.erase_node(node)
    if guards is not None and not gm.graph.find_nodes(op="call_module", target=GUARDS):
        delattr(gm, GUARDS)
    gm.recompile()
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    flat = pytree.tree_flatten_with_path((args, kwargs))[0]
    if len(flat) != len(placeholders):
        raise UserError(f"torch.export gave {len(placeholders)} graph inputs for {len(flat)} input values of "
                        f"{type(model).__name__}; pass plain tensors (or tuples/dicts of them) as the example input")
    constants = {name: v for name, (_, v) in zip(placeholders, flat, strict=True) if not isinstance(v, torch.Tensor)}
    where = tuple(pytree.keystr(p) for p, _ in flat)
    shapes = input_shapes(gm, ep.range_constraints, dict(zip(placeholders, where, strict=True)))
    codegen = getattr(gm.graph, "_codegen", None)
    info = getattr(codegen, "pytree_info", None)
    _strip_pytree_codegen(gm)
    return CapturedModel(module=model, graph=gm, blocks=(), inputs=tuple(placeholders), input_paths=where,
                         constants=constants, out_spec=info.out_spec if info is not None else None,
                         front_end="export", input_shapes=shapes, input_guards=guards)


def _unmarked(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs as new tensor objects (same data): torch.export records the dynamic dimensions it
    was asked for on the tensors it is given, and a retry with static shapes on them would fail."""
    def fresh(v: Any) -> Any:
        return v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v

    return pytree.tree_map(fresh, args), pytree.tree_map(fresh, kwargs)


def _canonical_names(gm: fx.GraphModule, model: nn.Module) -> None:
    """Refer to every parameter and buffer by its first name in the model (``named_parameters``
    order): torch.export picks any of a tied weight's names (GPT-2's embedding may read
    ``lm_head.weight``), but plans, stages and checkpoints must agree on one."""
    canonical: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(t), name)
    changed = False
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            first = canonical.get(id(graph_attr(gm, str(node.target))))
            if first is not None and first != node.target:
                graph_attr(gm, first)                      # the canonical name must exist on the graph module
                node.target = first
                changed = True
        except AttributeError:
            continue
    if changed:
        gm.recompile()


def _strip_pytree_codegen(gm: fx.GraphModule) -> None:
    """Make ``gm`` a plain graph: positional placeholders in, the flat output list out (and no
    input-structure check: hybridpipe feeds it flattened inputs itself)."""
    gm.graph._codegen = fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()
    gm.recompile()


def _keeping_functions(model: nn.Module, args: tuple, kwargs: dict, functions: list[str],
                       leaf_modules: tuple[type | str, ...], captured: CapturedModel) -> CapturedModel:
    """``captured`` if every custom autograd Function the model calls runs inside a leaf module (an
    exported graph holds the leaves as opaque calls, so export saw only the Functions outside them;
    an fx graph is checked on one forward); else a UserError naming the module to keep whole."""
    lost = list(functions)
    if captured.front_end == "fx":
        with side_effect_free(model), torch.enable_grad():
            kept = custom_functions(captured.graph(*args, *captured.constants.values()))
        lost = [f for f in functions if f not in kept]
    if lost:
        raise UserError(function_refusal(model, args, kwargs, lost, [_leaf_name(x) for x in leaf_modules]))
    if captured.front_end == "fx":
        log.warning("%s calls custom autograd Functions (%s): captured with torch.fx, the leaf modules run as "
                    "written", type(model).__name__, ", ".join(functions))
    return captured


def _leaf_name(leaf: type | str) -> str:
    return leaf.__name__ if isinstance(leaf, type) else leaf


def _fx_fallback(model: nn.Module, args: tuple, kwargs: dict, export_error: BaseException,
                 leaf_modules: tuple[type | str, ...] = ()) -> CapturedModel:
    from hybridpipe.profiles.trace import trace_model

    tensors_only = all(isinstance(a, torch.Tensor) for a in args) and not [
        k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if not tensors_only:
        raise UserError(export_failure_message(model, export_error)) from None
    try:
        gm = trace_model(model, leaf_modules)
    except UserError:
        raise UserError(export_failure_message(model, export_error)) from None
    log.warning("torch.export cannot capture %s (%s); using torch.fx's symbolic tracer instead",
                type(model).__name__, first_line(export_error))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = tuple(n.name for n in placeholders)
    paths = tuple(pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path((args, {}))[0])
    constants = {n.name: n.args[0] for n in placeholders[len(args):] if n.args}
    return CapturedModel(module=model, graph=gm, blocks=(), inputs=names[:len(args)] + tuple(constants),
                         input_paths=paths + tuple(f"default:{k}" for k in constants), constants=constants,
                         out_spec=None, front_end="fx", example_values=_fx_values(gm, args, constants))


def _fx_values(gm: fx.GraphModule, args: tuple, constants: dict[str, Any]) -> dict[str, Any]:
    """Every fx node's value for the example (fx graphs carry no value metadata)."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad(), side_effect_free(gm):
        Recorder(gm).run(*args, *constants.values())
    return values


def _unsendable_values(captured: CapturedModel) -> dict[str, str]:
    """Values (fx node names) whose type cannot travel between stages, with that type's name."""
    recorded = captured.example_values
    out = {}
    for node in captured.graph.graph.nodes:
        if not is_operation(node):
            continue
        value = recorded.get(node.name) if recorded is not None else node.meta.get("val")
        bad = unsendable(value)
        if bad is not None:
            out[node.name] = bad
    return out


# what the rest of hybridpipe imports from here: the capture, and (re-exported) the captured model and
# the calling conventions (profiles/captured.py, profiles/calling.py)
__all__ = ["CapturedModel", "capture_model", "autocast_context", "call_args", "own_loss", "training_switches",
           "unsendable", "tied_parameters", "node_parameters", "export_failure_message", "custom_functions",
           "check_leaf_modules"]
