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

The weight half accumulates through autograd (``torch.autograd.backward`` with ``inputs=``), so
parameters' post-accumulate-grad hooks fire as in a plain backward, once per parameter (a
parameter reached through several intermediates gets their sum in one pass; only a parameter of a
group without formulas that also reaches an output not depending on the inputs is accumulated in
two passes): the replicas' per-layer gradient sync (comm/hybrid_dp) starts from them as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from hybridpipe.pipeline.weightgrads import NodeWeightGrad, take


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
    groups: list[_Group] = field(default_factory=list)             # the rest, each its own autograd pass
    roots: list[GradientEdge] = field(default_factory=list)        # outputs that do not depend on the inputs
    root_grads: list[torch.Tensor] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)       # what the one pass accumulates into
    one_pass: bool = False          # every group in one autograd pass (a recomputing stage; module docstring)

    def held(self) -> list[torch.Tensor]:
        """The saved tensors kept for the formulas (the memory meter counts them until the weight half)."""
        return [t for d in self.direct for t in d.held]

    def recorded(self) -> list[torch.Tensor]:
        """The gradients the input half recorded for the weight half (at each intermediate, and the
        outputs' that do not depend on the inputs: on a stage whose inputs need none, every output's):
        alive until the weight half, as :meth:`held` (the memory meter counts both)."""
        out = [d.grad for d in self.direct if d.grad is not None]
        out += [g for group in self.groups for grads in group.grads for g in grads or () if g is not None]
        return out + list(self.root_grads)

    @property
    def keeps_graph(self) -> bool:
        """The input half kept the whole autograd graph (a group without formulas): everything the
        forward saved stays until the weight half (the profiler's ``weight_half_bytes``)."""
        return bool(self.groups)


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter], *,
                   one_pass: bool = False) -> WeightWork:
    """Accumulate the gradients of ``inputs`` (leaves) from ``outputs`` (with ``output_grads``;
    None = ones for a scalar loss); return what :func:`backward_weight` needs for ``params``
    (``one_pass``: in a single autograd pass, for a stage that recomputes its forward)."""
    # imported here: torch.distributed.pipelining imports torch._dynamo (seconds of a worker's start)
    from torch.distributed.pipelining._backward import construct_reverse_graph, reverse_closure

    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    work = WeightWork(one_pass=one_pass)
    if not outputs:
        return work
    reverse = construct_reverse_graph(_nodes(outputs))
    closure = reverse_closure(_nodes(wanted), set(), reverse)[0] if wanted else set()
    groups = _groups(params, closure, reverse, reverse_closure)
    grouped = {id(p) for group in groups for p in group.params}
    for out, g in zip(outputs, output_grads, strict=True):
        edge = get_gradient_edge(out)
        if edge.node not in closure:
            work.roots.append(edge)
            work.root_grads.append(torch.ones_like(out) if g is None else g)
    work.params = [p for p in params if id(p) not in grouped]
    if not wanted:
        return work
    for group in groups:
        direct = None if one_pass else _direct(group, closure)
        if direct is None:
            work.groups.append(group)
        else:
            work.direct.extend(direct)
            work.params.extend(group.params)
    handles = [d.node.register_prehook(lambda grads, d=d: _record(d, grads)) for d in work.direct]
    for group in work.groups:
        for i, node in enumerate(group.intermediates):
            def record(grads, group=group, i=i):
                group.grads[i] = grads
            handles.append(node.register_prehook(record))
    try:
        grads = torch.autograd.grad(list(outputs), wanted, list(output_grads), retain_graph=bool(work.groups),
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(wanted, grads, strict=True):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g
    return work


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


def _direct(group: _Group, closure: set[Node]) -> list[NodeWeightGrad] | None:
    """Formulas for every intermediate of ``group`` (their next edges outside the input path), or None."""
    out = []
    for node in group.intermediates:
        side = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None and fn not in closure]
        d = take(node, side)
        if d is None:
            return None
        out.append(d)
    return out


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
    for d in work.direct:
        d_edges, d_grads = d.edges()
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
        passes = [([e for p in passes for e in p[0]], [g for p in passes for g in p[1]],
                   work.params + [p for group in work.groups for p in group.params])]
    try:
        for pass_edges, pass_grads, params in passes:
            if pass_edges:      # a group's pass may run nodes another's runs again: the graph stays till the end
                torch.autograd.backward(pass_edges, pass_grads, inputs=params, retain_graph=bool(work.groups))
    finally:
        for h in handles:
            h.remove()
    work.direct.clear()
    work.groups.clear()
    work.roots.clear()
    work.root_grads.clear()
