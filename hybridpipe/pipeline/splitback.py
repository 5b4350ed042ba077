"""A backward split in two (zero-bubble schedules): input gradients now, weight gradients later.

``backward_input`` computes only the gradients of the stage's inputs (what the previous stage
waits for). On the way it records, at every autograd node where a parameter's gradient path
meets the input-gradient path (an "intermediate", as in torch's
``torch.distributed.pipelining._backward``, whose graph walk this reuses), the gradient that
flowed into it. ``backward_weight`` then takes each intermediate from that recorded gradient to
the parameters only: the weight half is never a second backward from the outputs.

Most intermediates are a matrix product, a layer norm or an addition
(``weightgrads.py``): their parameter-side gradients are computed straight from the node's saved
tensors, which the input half reads before it runs, so it frees the graph as it goes, as a plain
backward does (the weight half holds only those tensors and the recorded gradients). The rest of the
way to the parameters (a transpose, a cast) and every parameter whose path never meets the inputs'
(a bias or position embedding that does not depend on the stage's inputs, every parameter of stage
0, whose inputs need no gradient) run as ONE autograd pass from those edges and from the outputs
that do not depend on the inputs; nothing on the input-gradient path lies below them, so nothing
there runs twice. A stage whose intermediates include a node without such a formula keeps the graph
for them: each such group runs as its own autograd pass from its intermediates (a single pass from
every group's intermediates would also run every node on the input-gradient path between two of
them: most of the backward again, 1.81x a plain one on GPT-2). Under activation recomputation
(``one_pass``) the graph is kept and everything is one autograd pass: every graph task reruns the
checkpointed forward, and reading a saved tensor would rerun it too.

The parameter-side gradients that cost no product (layer norm's weight and bias, which its kernel
makes in the same call as the input's; a bias broadcast over a product's rows, the output gradient
summed) are taken by the input half itself, as extra ``inputs`` of its ``autograd.grad``, where a
parameter's only edge brings them (so the taken gradient is the whole one a plain backward
accumulates) and it has no tensor hook: layer norm's backward runs once, as in a plain backward,
not once a half, and the weight half holds neither its saved tensors nor its recorded gradient,
only each deferred product's operands (for GPT-2's blocks: the input and the output gradient of
every ``Conv1D``). The weight half still accumulates them, so every hook fires there. A recomputing
stage (one pass, below) takes them too where a group's every edge off the input path is one (a layer
norm's), so it records what the profile measures without recomputation; the weight half accumulates
those in a pass of their own, since its one pass runs the input path again through the layer norm.

The weight half accumulates through autograd (``torch.autograd.backward`` with ``inputs=``), so
parameters' post-accumulate-grad hooks fire as in a plain backward, once per parameter (a
parameter reached through several intermediates gets their sum in one pass; only a parameter of a
group without formulas that also reaches an output not depending on the inputs is accumulated in
two passes): the replicas' per-layer gradient sync (comm/hybrid_dp) starts from them as usual.

Where the cut lies is found once per graph structure and kept across a stage's micro-batches
(``splitplan.py``); each micro-batch still takes its formulas' saved tensors from its own nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from hybridpipe.pipeline.splitplan import Plan, SplitPlans, walk
from hybridpipe.pipeline.weightgrads import ACCUMULATE, NodeWeightGrad, cheap, param_edge, take


@dataclass
class _Group:
    """Parameters and the intermediates their gradients pass through, taken by autograd."""

    params: list[nn.Parameter]
    intermediates: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None]      # recorded at each intermediate


@dataclass
class WeightWork:
    """What the weight half of one micro-batch's backward needs (see the module docstring)."""

    direct: list[NodeWeightGrad] = field(default_factory=list)     # intermediates with a formula
    early: list[tuple[Node, torch.Tensor]] = field(default_factory=list)   # (accumulator, gradient) taken in B
    groups: list[_Group] = field(default_factory=list)             # the rest, each its own autograd pass
    roots: list[GradientEdge] = field(default_factory=list)        # outputs that do not depend on the inputs
    root_grads: list[torch.Tensor] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)       # what the one pass accumulates into
    one_pass: bool = False          # every group in one autograd pass (a recomputing stage; module docstring)
    views: dict[Node, GradientEdge] = field(default_factory=dict)    # edges through parameters' views (edges())

    def held(self) -> list[torch.Tensor]:
        """The saved tensors kept for the formulas (the memory meter counts them until the weight half)."""
        return [t for d in self.direct for t in d.held]

    def recorded(self) -> list[torch.Tensor]:
        """The gradients the input half recorded for the weight half (at each intermediate, and the
        outputs' that do not depend on the inputs: on a stage whose inputs need none, every output's):
        alive until the weight half, as :meth:`held` (the memory meter counts both)."""
        out = [d.grad for d in self.direct if d.grad is not None] + [g for _, g in self.early]
        out += [g for group in self.groups for grads in group.grads for g in grads or () if g is not None]
        return out + list(self.root_grads)

    @property
    def keeps_graph(self) -> bool:
        """The input half kept the whole autograd graph (a group without formulas): everything the
        forward saved stays until the weight half (the profiler's ``weight_half_bytes``)."""
        return bool(self.groups)


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter], *,
                   one_pass: bool = False, plans: SplitPlans | None = None) -> WeightWork:
    """Accumulate the gradients of ``inputs`` (leaves) from ``outputs`` (with ``output_grads``;
    None = ones for a scalar loss); return what :func:`backward_weight` needs for ``params``
    (``one_pass``: in a single autograd pass, for a stage that recomputes its forward; ``plans``:
    the cut plans kept across the stage's micro-batches, ``splitplan.py``)."""
    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    work = WeightWork(one_pass=one_pass, views=plans.views if plans is not None else {})
    if not outputs:
        return work
    edges = [get_gradient_edge(out) for out in outputs]
    graph = walk([e.node for e in edges], _nodes(wanted), params, one_pass)
    plan = plans.get(graph.key) if plans is not None else None
    if plan is None or not _apply(plan, graph.nodes, work, params):
        if plan is not None and plans is not None:
            plans.forget(graph.key)
        plan = _plan(edges, wanted, params, one_pass, graph.index)
        work = WeightWork(one_pass=one_pass, views=work.views)
        assert _apply(plan, graph.nodes, work, params)      # its formulas were just taken from these nodes
        if plans is not None:
            plans.put(graph.key, plan)
    for k in plan.roots:
        work.roots.append(edges[k])
        g = output_grads[k]
        work.root_grads.append(torch.ones_like(outputs[k]) if g is None else g)
    if not wanted:
        return work
    early: list[torch.Tensor] = [params[k] for k, _ in plan.early]
    handles = [d.node.register_prehook(lambda grads, d=d: _record(d, grads)) for d in work.direct]
    for group in work.groups:
        for i, node in enumerate(group.intermediates):
            def record(grads, group=group, i=i):
                group.grads[i] = grads
            handles.append(node.register_prehook(record))
    try:
        grads = torch.autograd.grad(list(outputs), wanted + early, list(output_grads), retain_graph=bool(work.groups),
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(wanted, grads[:len(wanted)], strict=True):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g
    work.early = [(graph.nodes[i], g) for (_, i), g in zip(plan.early, grads[len(wanted):], strict=True)
                  if g is not None]
    return work


def _plan(edges: list[GradientEdge], wanted: list[torch.Tensor], params: list[nn.Parameter], one_pass: bool,
          index: dict[Node, int]) -> Plan:
    """The cut of this graph, found afresh (torch's reverse-graph walk), by position."""
    # imported here: torch.distributed.pipelining imports torch._dynamo (seconds of a worker's start)
    from torch.distributed.pipelining._backward import construct_reverse_graph, reverse_closure

    reverse = construct_reverse_graph([e.node for e in edges])
    closure = reverse_closure(_nodes(wanted), set(), reverse)[0] if wanted else set()
    groups = _groups(params, closure, reverse, reverse_closure) if wanted else []
    position = {id(p): k for k, p in enumerate(params)}
    grouped = {id(p) for group in groups for p in group.params}
    direct, direct_params, kept, early = [], [], [], []
    for group in groups:
        sides = _early_only(group, closure, reverse, position) if one_pass else _sides(group, closure)
        if sides is None:
            kept.append((tuple(position[id(p)] for p in group.params), tuple(index[n] for n in group.intermediates)))
            continue
        for n, side in sides:
            taken = [i for i in side if _early(n, i, reverse, position)]
            accs: list[Any] = [n.next_functions[i][0] for i in taken]      # parameters' accumulators (_early)
            early += [(position[id(acc.variable)], index[acc]) for acc in accs]
            late = tuple(i for i in side if i not in taken)
            if late:
                direct.append((index[n], late))
        direct_params += [position[id(p)] for p in group.params]
    return Plan(roots=tuple(k for k, e in enumerate(edges) if e.node not in closure),
                free=tuple(k for k, p in enumerate(params) if id(p) not in grouped),
                direct=tuple(direct), direct_params=tuple(direct_params), early=tuple(early), groups=tuple(kept))


def _early_only(group: _Group, closure: set[Node], reverse: dict[Node, list[Node]], position: dict[int, int]
                ) -> list[tuple[Node, tuple[int, ...]]] | None:
    """A recomputing stage's group (one pass, no formulas) whose every edge off the input path the
    input half takes (:func:`_early`: layer norm's weight and bias): its intermediates with those
    edges, so it records nothing for the weight half, as without recomputation; None otherwise."""
    out = []
    for node in group.intermediates:
        side = _off_path(node, closure)
        if not all(_early(node, i, reverse, position) for i in side):
            return None
        out.append((node, side))
    return out


def _early(node: Node, i: int, reverse: dict[Node, list[Node]], position: dict[int, int]) -> bool:
    """Whether the input half takes ``node``'s parameter-side edge ``i``: a gradient costing no
    product (``weightgrads.cheap``) straight into the accumulator of one of the parameters, its only
    edge (the gradient the input half takes is then the parameter's whole, as a plain backward
    sums it) and no tensor hook on it (it would run on the taken gradient, then on accumulating)."""
    acc = node.next_functions[i][0]
    if not cheap(node, i) or acc is None or acc.name() != ACCUMULATE:
        return False
    var = acc.variable          # type: ignore[attr-defined]
    return id(var) in position and not var._backward_hooks and len(reverse[acc]) == 1


def _apply(plan: Plan, nodes: list[Node], work: WeightWork, params: list[nn.Parameter]) -> bool:
    """Fill ``work``'s formulas, groups and parameters from ``plan`` on this graph's ``nodes``;
    False where a planned formula does not apply to the node's saved tensors (a fresh plan then)."""
    for i, side in plan.direct:
        d = take(nodes[i], side)
        if d is None:
            return False
        work.direct.append(d)
    work.params = [params[k] for k in plan.free] + [params[k] for k in plan.direct_params]
    work.groups = [_Group([params[k] for k in ps], [nodes[i] for i in ns], [None] * len(ns)) for ps, ns in plan.groups]
    return True


def _record(d: NodeWeightGrad, grads: tuple[torch.Tensor | None, ...]) -> None:
    d.grad = grads[0]


def _groups(params: list[nn.Parameter], closure: set[Node], reverse, reverse_closure) -> list[_Group]:
    """The parameters grouped by the intermediates their gradient paths meet the input path at
    (torch's ``get_param_groups``, with groups that share a parameter or an intermediate merged:
    each parameter in exactly one); parameters that meet none are in no group."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    parent: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    hits = []
    for p in params:
        acc = _get_grad_fn_or_grad_acc(p)
        hit = list(reverse_closure([acc], closure, reverse)[1]) if closure and acc is not None else []
        if hit:
            for n in hit:
                parent.setdefault(n, n)
            for n in hit[1:]:
                parent[find(n)] = find(hit[0])
            hits.append((p, hit))
    by_root: dict[Node, _Group] = {}
    for p, hit in hits:
        group = by_root.setdefault(find(hit[0]), _Group([], [], []))
        group.params.append(p)
        for n in hit:
            if n not in group.intermediates:
                group.intermediates.append(n)
                group.grads.append(None)
    return list(by_root.values())


def _sides(group: _Group, closure: set[Node]) -> list[tuple[Node, tuple[int, ...]]] | None:
    """Each intermediate of ``group`` with its next edges outside the input path, or None where one
    has no formula (``weightgrads.take``)."""
    out = []
    for node in group.intermediates:
        side = _off_path(node, closure)
        if take(node, side) is None:
            return None
        out.append((node, side))
    return out


def _off_path(node: Node, closure: set[Node]) -> tuple[int, ...]:
    """``node``'s next edges that leave the input path (toward parameters)."""
    return tuple(i for i, (fn, _) in enumerate(node.next_functions) if fn is not None and fn not in closure)


def _nodes(tensors: Sequence[torch.Tensor]) -> list[Node]:
    """The autograd nodes that produced ``tensors`` (a leaf's gradient accumulator)."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return [n for n in map(_get_grad_fn_or_grad_acc, tensors) if n is not None]


def backward_weight(work: WeightWork) -> None:
    """Accumulate the parameters' gradients of one micro-batch from :func:`backward_input`'s record
    (through autograd, so gradient hooks fire), and release what it held.

    One autograd pass from the formulas' edges and the input-independent outputs; then one per
    group without formulas, from its intermediates, each given the gradient it received in the
    input half (a prehook replaces what flows into it: for an intermediate below another, that
    recorded gradient is already whole). With ``work.one_pass`` all of it one pass (see the
    module docstring)."""
    edges: list[GradientEdge] = list(work.roots)
    grads: list[torch.Tensor] = list(work.root_grads)
    taken = ([param_edge(acc, work.views) for acc, _ in work.early], [g for _, g in work.early],
             [acc.variable for acc, _ in work.early])       # type: ignore[attr-defined]
    if not work.one_pass:
        edges += taken[0]
        grads += taken[1]
    pending, work.direct = work.direct[::-1], []
    while pending:      # each formula's operands freed once it ran: the next product's output may reuse them
        d_edges, d_grads = pending.pop().edges(work.views)
        edges += d_edges
        grads += d_grads
    # an input-independent output may also reach a parameter of a group below (accumulated in both passes)
    params = work.params + ([p for group in work.groups for p in group.params] if work.roots else [])
    passes = [(edges, grads, params)]
    handles = []
    for group in work.groups:
        group_edges, group_grads = [], []
        for recorded, node in zip(group.grads, group.intermediates, strict=True):
            for i, grad in enumerate(recorded or ()):
                if grad is not None:
                    group_edges.append(GradientEdge(node, i))
                    group_grads.append(grad)
            handles.append(node.register_prehook(lambda _grads, saved=recorded: saved))
        passes.append((group_edges, group_grads, group.params))
    if work.one_pass:
        # the taken gradients apart: the one pass runs the input path again, through their layer norms
        # (no intermediate of a group any more), and would accumulate them a second time
        own = {id(p) for p in taken[2]}
        passes = [([e for p in passes for e in p[0]], [g for p in passes for g in p[1]],
                   [p for p in work.params if id(p) not in own] + [p for group in work.groups for p in group.params]),
                  taken]
    try:
        for pass_edges, pass_grads, params in passes:
            if pass_edges:      # a group's pass may run nodes another's runs again: the graph stays till the end
                _accumulate(pass_edges, pass_grads, params, retain_graph=bool(work.groups))
    finally:
        for h in handles:
            h.remove()
    work.direct.clear()
    work.early.clear()
    work.groups.clear()
    work.roots.clear()
    work.root_grads.clear()


def _accumulate(edges: list[GradientEdge], grads: list[torch.Tensor], params: list[nn.Parameter],
                retain_graph: bool) -> None:
    """``torch.autograd.backward(edges, grads, inputs=params)`` without its Python checks of each
    gradient's shape and dtype (``_make_grads``, 1-2 ms per micro-batch on a GPT-2 stage): every
    gradient here is already shaped and cast to its edge's metadata (``weightgrads.py``)."""
    if not params:          # torch.autograd.backward's own error for an empty ``inputs``
        torch.autograd.backward(edges, grads, inputs=params, retain_graph=retain_graph)
        return
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(tuple(edges), tuple(grads), retain_graph, False, tuple(params),
                         allow_unreachable=True, accumulate_grad=True)
