"""Cutting a traced model into pipeline stages at a plan's node ranges (torch.fx graph surgery).

Node ids are positions in ``gm.graph.nodes`` (the profile's ids, see profiles/trace.py). Stage
s holds nodes ``first..last`` of its range. A graph value computed in stage a and read in stage
b > a crosses every cut in between: stages a..b-1 send it, stages a+1..b receive it, so a skip
connection that jumps several stages is relayed stage by stage and only neighbours ever talk.

Each stage becomes its own ``fx.GraphModule`` built from the model's graph by copying its nodes
(``Graph.node_copy``), with one placeholder per received value and an output of the values it
sends (the model's output on the last stage). The GraphModule is rooted at the traced model, so
its submodules and parameters are the model's own objects under their original qualified names:
a stage's ``state_dict()`` keys are the model's keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from hybridpipe.errors import UserError
from hybridpipe.profiles.trace import attr_target


@dataclass(frozen=True)
class StageBoundary:
    """What one stage receives and sends (graph value names = fx node names, in node order)."""

    index: int
    first_node: int
    last_node: int
    inputs: tuple[str, ...]     # values received from the previous stage (model inputs on stage 0)
    outputs: tuple[str, ...]    # values sent to the next stage (empty on the last stage)
    relayed: tuple[str, ...]    # inputs passed on unchanged to the next stage (skips over this stage)


def check_ranges(ranges: Sequence[tuple[int, int]], n_nodes: int) -> None:
    """Ranges must be contiguous, non-empty and cover nodes 0..n_nodes-1 in order."""
    expected = 0
    for i, (first, last) in enumerate(ranges):
        if first != expected or last < first:
            raise UserError(f"stage {i} covers nodes {first}..{last} but must start at node {expected} and "
                            "not be empty (stages are contiguous node ranges); re-partition")
        expected = last + 1
    if expected != n_nodes:
        raise UserError(f"the stages cover {expected} graph nodes but the model has {n_nodes}: the plan was made "
                        "for another version of the model; re-profile and re-partition")


def stage_boundaries(gm: fx.GraphModule, ranges: Sequence[tuple[int, int]]) -> list[StageBoundary]:
    """The inputs and outputs of every stage when ``gm`` is cut at ``ranges`` (inclusive node ranges)."""
    nodes = list(gm.graph.nodes)
    check_ranges(ranges, len(nodes))
    index = {n: i for i, n in enumerate(nodes)}
    stage_of = [0] * len(nodes)
    for s, (first, last) in enumerate(ranges):
        for i in range(first, last + 1):
            stage_of[i] = s
    _check_placement(nodes, stage_of, len(ranges))
    crossing: list[list[str]] = [[] for _ in ranges]   # crossing[c]: values crossing the cut after stage c
    for i, node in enumerate(nodes):
        users = [index[u] for u in node.users]
        if users and max(stage_of[u] for u in users) > stage_of[i]:
            for c in range(stage_of[i], max(stage_of[u] for u in users)):
                crossing[c].append(node.name)
    out = []
    for s, (first, last) in enumerate(ranges):
        inputs = tuple(crossing[s - 1]) if s else tuple(n.name for n in nodes[first:last + 1] if n.op == "placeholder")
        outputs = tuple(crossing[s]) if s < len(ranges) - 1 else ()
        relayed = tuple(v for v in inputs if v in outputs)
        out.append(StageBoundary(s, first, last, inputs, outputs, relayed))
    return out


def _check_placement(nodes: list[fx.Node], stage_of: list[int], n_stages: int) -> None:
    """Model inputs on stage 0, the output on the last stage, no module or parameter in two stages."""
    for i, node in enumerate(nodes):
        if node.op == "placeholder" and stage_of[i] != 0:
            raise UserError(f"model input {node.name!r} (node {i}) is placed on stage {stage_of[i]}; model inputs "
                            "must be on stage 0: re-partition")
    if nodes[-1].op != "output" or stage_of[-1] != n_stages - 1:
        raise UserError("the model's output node must be the last node, on the last stage; re-partition")
    where: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.op not in ("call_module", "get_attr"):
            continue
        seen = where.setdefault(attr_target(node), stage_of[i])
        if seen != stage_of[i]:
            raise UserError(f"module or parameter {node.target!r} is used by stages {seen} and {stage_of[i]} "
                            "(weights shared across stages cannot be kept in sync); re-partition so that its "
                            "uses fall in one stage, or mark the module that reuses it as a leaf")


def stage_graph_module(gm: fx.GraphModule, boundary: StageBoundary, last: bool) -> fx.GraphModule:
    """A GraphModule computing one stage: positional inputs ``boundary.inputs``, returns a tuple of
    ``boundary.outputs`` (or, on the last stage, the model's output value)."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in boundary.inputs:
        env[by_name[name]] = graph.placeholder(name)
    result = None
    for node in nodes[boundary.first_node:boundary.last_node + 1]:
        if node.op == "placeholder":
            continue  # stage 0's model inputs were added above
        if node.op == "output":
            result = fx.map_arg(node.args[0], lambda n: env[n])
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    if last:
        graph.output(result)
    else:
        graph.output(tuple(env[by_name[name]] for name in boundary.outputs))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=f"Stage{boundary.index}")
