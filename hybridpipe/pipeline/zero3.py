"""ZeRO-3 inside a stage: each sync unit's weights gathered just before the stage's graph uses them
(and ZeRO-1/2's all-gather of the updated weights waited for there: overlapped with the forward).

:func:`gate_stage` puts two gates per sync unit into the stage's fx graph (a submodule called
with the unit's index): one right before the first operation that reads the unit's weights (it
waits for the unit's all-gather, starting it if none is on its way, then starts the gather of the
unit the forward uses next: the prefetch, on the replicas' lane while this unit computes) and one
right after the last (with ``reshard_after_forward``, or in an evaluation without autograd, it
frees the unit's full weights; kept otherwise until the step's update, comm/sharded).

The backward needs the weights again: the stage's forward runs under saved-tensor hooks (on top of
whatever hooks are active: the memory meter's, checkpoint's) that keep a weight autograd saves as
itself, marked with its unit, and regather that unit when the backward unpacks it. A recomputing
stage's rerun passes the same gates (its forwards inside a backward free nothing). With
``reshard_after_forward`` the unit is freed again once its gradients are complete (comm/sharded)
and, for what is left (a split backward's input half), when the backward ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from hybridpipe.comm.sharded.gathered import LazyGathers, UnitWeights

GATE = "_zero3_gate"
_WEIGHT = object()


class Gate(nn.Module):
    """The graph's gate: ``gate(unit, True)`` before the unit's first use, ``gate(unit, False)`` after its last."""

    _is_impure = True       # kept by dead-code elimination: it has no outputs

    def __init__(self, weights: UnitWeights | LazyGathers, reshard: bool):
        super().__init__()
        self.reshard = reshard
        self._weights = (weights,)          # not a submodule: no state of the stage's
        self._freeing_queued = False

    @property
    def weights(self) -> UnitWeights | LazyGathers:
        return self._weights[0]

    def forward(self, unit: int, before: bool) -> None:
        w = self.weights
        if before:
            w.need(unit)
            k = w.order.index(unit)
            if k + 1 < len(w.order):
                w.gather(w.order[k + 1])
        elif (self.reshard or not torch.is_grad_enabled()) and torch._C._current_graph_task_id() == -1 \
                and unit not in getattr(w, "pinned", ()):
            w.free(unit)

    def needed_in_backward(self, unit: int) -> None:
        """A saved weight of ``unit`` is unpacked: gather it. With resharding, the units the forward
        uses after it are done (the backward runs the other way; one needed again is regathered):
        free them, prefetch the unit before it, and free what is left when the backward ends."""
        w = self.weights
        if not self.reshard or unit in getattr(w, "pinned", ()):
            w.need(unit)        # a pinned unit (a leaf module's) is still gathered: nothing to free or prefetch
            return
        k = w.order.index(unit)
        for later in w.order[k + 1:]:
            w.free(later)
        w.need(unit)
        if k > 0:
            w.gather(w.order[k - 1])
        if not self._freeing_queued:
            self._freeing_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._freeing_queued = False
        self.weights.free_all()


def gate_stage(stage: Any, weights: UnitWeights | LazyGathers, reshard: bool) -> Gate:
    """Gate the graph of ``stage`` (a PipelineStage: its module's graph and, if it has one, the
    plain graph its evaluation runs) on ``weights``' units (ZeRO-3's, or ZeRO-1/2's gathers of the
    updated weights: LazyGathers, waited for at the gates); set their forward order."""
    module: fx.GraphModule = stage.module
    gate = Gate(weights, reshard)
    module.add_module(GATE, gate)
    unit_of = {id(p): i for i, ps in enumerate(weights.params) for p in ps}
    weights.order = _gate_graph(module.graph, module, unit_of)
    module.recompile()
    if isinstance(weights, LazyGathers):
        weights.gated = True
    if getattr(stage, "_plain_graph", None) is not None:
        _gate_graph(stage._plain_graph, module, unit_of)
    stage._eval_module = None
    if isinstance(weights, UnitWeights):          # ZeRO-1/2's weights are never freed: nothing to regather
        _regather_saved(module, weights, gate)
    return gate


def _regather_saved(module: nn.Module, weights: UnitWeights, gate: Gate) -> None:
    """Run ``module``'s forwards under the saved-tensor hooks of :func:`_hooks`."""
    top = _top_hooks()
    pushed: list[bool] = []

    def pre(*_: Any) -> None:
        outer = top()
        torch._C._autograd._push_saved_tensors_default_hooks(*_hooks(weights, gate, outer))
        pushed.append(True)

    def post(*_: Any) -> None:
        if pushed:
            pushed.pop()
            torch._C._autograd._pop_saved_tensors_default_hooks()
    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def gate_stages(stages: Iterable[Any], syncs: Iterable[Any]) -> None:
    """Gate each stage whose sync (the same order) has gates: a ShardedReplicas (comm/sharded)."""
    for stage, sync in zip(stages, syncs, strict=True):
        gates = getattr(sync, "gates", None)
        if gates is not None:
            gate_stage(stage, gates, sync.reshard_after_forward)


def _hooks(weights: UnitWeights, gate: Gate, outer: Any) -> tuple[Callable, Callable]:
    """Saved-tensor hooks: a weight of a unit kept as itself and regathered on unpack, the rest to ``outer``."""
    def pack(t: torch.Tensor) -> Any:
        unit = weights.unit_of(t)
        if unit is not None:
            return (_WEIGHT, unit, t)
        return (None, outer[0](t) if outer is not None else t)

    def unpack(saved: Any) -> torch.Tensor:
        if saved[0] is _WEIGHT:
            gate.needed_in_backward(saved[1])
            return saved[2]
        return outer[1](saved[1]) if outer is not None else saved[1]
    return pack, unpack


def _top_hooks() -> Callable[[], Any]:
    autograd = torch._C._autograd
    return lambda: autograd._top_saved_tensors_default_hooks(False)


def _gate_graph(graph: fx.Graph, module: nn.Module, unit_of: dict[int, int]) -> list[int]:
    """Insert the gates into ``graph``; the units in the order of their first use."""
    nodes = list(graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    uses: dict[int, list[fx.Node]] = {}
    for node in nodes:
        if node.op == "get_attr":
            owner = unit_of.get(id(_attr(module, str(node.target))))
            if owner is not None:
                uses.setdefault(owner, []).extend(node.users)
        elif node.op == "call_module" and node.target != GATE:
            for p in module.get_submodule(str(node.target)).parameters():
                if id(p) in unit_of:
                    uses.setdefault(unit_of[id(p)], []).append(node)
    order = sorted(uses, key=lambda u: min(position[n] for n in uses[u]))
    for unit in order:
        first = min(uses[unit], key=position.__getitem__)
        last = max(uses[unit], key=position.__getitem__)
        with graph.inserting_before(first):
            graph.call_module(GATE, (unit, True))
        with graph.inserting_after(last):
            graph.call_module(GATE, (unit, False))
    return order + sorted(set(unit_of.values()) - set(uses))


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

