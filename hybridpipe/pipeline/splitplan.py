"""The split backward's cut plan, kept across a stage's micro-batches (``splitback.py``).

Which autograd nodes are the intermediates (where a parameter's gradient path meets the
input-gradient path), which parameters each group holds and which outputs do not depend on the
inputs is the same for every micro-batch of a stage whose autograd graph has the same structure;
finding it afresh (torch's reverse-graph walk and one reverse closure per parameter) took 0.53 ms
of Python per micro-batch on a GPT-2 stage of 4 layers, walking and applying a kept plan 0.28 ms
(RESULTS.md 8g, splitc). A :class:`Plan` says it by position: nodes
by their order in one breadth-first walk from the outputs, parameters and outputs by their
position in the lists given. The walk also makes the graph's signature (each node's name and
next edges, which parameter each gradient accumulator is and whether it has a tensor hook, where the
outputs and the inputs are),
the key a plan is kept under: a graph whose structure differs in anything gets a fresh plan, never
a stale one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.autograd.graph import GradientEdge, Node

from hybridpipe.pipeline.weightgrads import ACCUMULATE


@dataclass(frozen=True)
class Plan:
    """The cut of one graph structure, by position (module docstring)."""

    roots: tuple[int, ...]                                  # outputs not depending on the inputs
    free: tuple[int, ...]                                   # parameters in no group
    direct: tuple[tuple[int, tuple[int, ...]], ...]         # (intermediate, its edges left to the weight half)
    direct_params: tuple[int, ...]                          # the parameters of the groups with formulas
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]     # (parameters, intermediates): autograd's
    early: tuple[tuple[int, int], ...] = ()                 # (parameter, its accumulator): taken in the input half


@dataclass
class Walk:
    """One breadth-first walk of a graph: its nodes in order, their positions, its signature."""

    nodes: list[Node]
    index: dict[Node, int]
    key: Hashable


def walk(outputs: Sequence[Node], wanted: Sequence[Node], params: Sequence[nn.Parameter], one_pass: bool) -> Walk:
    """Walk the graph below ``outputs`` (nodes, one per output), keyed by its structure, the
    positions of ``wanted`` (the inputs' nodes) and which of ``params`` each accumulator is."""
    which = {id(p): k for k, p in enumerate(params)}
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    for n in outputs:
        if n not in index:
            index[n] = len(nodes)
            nodes.append(n)
    rows = []
    i = 0
    while i < len(nodes):
        node = nodes[i]
        i += 1
        name = node.name()
        row: list[object] = [name]
        if name == ACCUMULATE:
            var = node.variable                                  # type: ignore[attr-defined]
            # a tensor hook would run on a gradient the input half takes, then again when it is accumulated
            row += (which.get(id(var), -1), bool(var._backward_hooks))
        for fn, nr in node.next_functions:
            if fn is None:
                row.append(-1)
                continue
            j = index.get(fn)
            if j is None:
                j = index[fn] = len(nodes)
                nodes.append(fn)
            row += (j, nr)
        rows.append(tuple(row))
    key = (one_pass, len(params), tuple(index[n] for n in outputs), tuple(index.get(n, -1) for n in wanted),
           tuple(rows))
    return Walk(nodes, index, key)


class SplitPlans:
    """The plans of one stage's graphs, by signature (the last few kept)."""

    def __init__(self, size: int = 4):
        self._plans: dict[Hashable, Plan] = {}
        self._size = size
        self.hits = 0
        self.views: dict[Node, GradientEdge] = {}   # parameters' view edges for the weight half (weightgrads.py)
        self.misses = 0

    def get(self, key: Hashable) -> Plan | None:
        """The plan kept for ``key`` (counted as a hit), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
        return plan

    def put(self, key: Hashable, plan: Plan) -> None:
        """Keep ``plan`` for ``key`` (a miss), dropping the oldest past the size."""
        self.misses += 1
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > self._size:
            del self._plans[next(iter(self._plans))]

    def forget(self, key: Hashable) -> None:
        """Drop the plan for ``key`` (its formulas no longer apply to this graph's saved tensors)."""
        self._plans.pop(key, None)
