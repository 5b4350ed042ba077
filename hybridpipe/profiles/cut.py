"""Cutting a captured model into pieces at block ranges (torch.fx graph surgery): pipeline stages at a
plan's ranges, or every block alone for the profiler.

Block ids are the profile's node ids (profiles/blocks.py); stage s holds blocks
``first..last`` of its range, i.e. every graph operation of those blocks. A value computed in
stage a and read in stage b > a crosses every cut in between: stages a..b-1 send it, stages
a+1..b receive it, so a skip connection that jumps several stages is relayed stage by stage and
only neighbours ever talk. The model's inputs enter at stage 0 and are relayed the same way to
the stages that read them (an HF model's ``labels``, read by the loss in the last block).

What is *not* sent: parameters and buffers (every stage that reads one refers to it under the
model's own name: a weight read by two stages -- tied embeddings -- lives on both, see
runtime/tied.py) and constant inputs (``use_cache=False``), which are written into the stage's
graph. What is sent may be a tensor or a small Python value (an int from ``x.size(0)``, None, a
shape tuple): values.py carries the latter as metadata beside the tensors. A value of any other
type cannot cross a cut; :func:`check_cuts` says which and where, before anything runs.

Each stage becomes its own ``fx.GraphModule`` built from the captured graph by copying its nodes
(``Graph.node_copy``), with one placeholder per received value and an output of the values it
sends (the model's flat output on the last stage). The GraphModule is rooted at the captured
graph, so its parameters are the model's own objects under their original qualified names: a
stage's ``state_dict()`` keys are the model's keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.blocks import is_operation
from hybridpipe.profiles.capture import CapturedModel
from hybridpipe.profiles.captured import graph_attr, kept_buffers


@dataclass(frozen=True)
class StageBoundary:
    """What one stage receives and sends (graph value names, in graph order)."""

    index: int
    first_node: int               # first block (profile node id)
    last_node: int                # last block
    inputs: tuple[str, ...]       # values received from the previous stage (the model's inputs on stage 0)
    outputs: tuple[str, ...]      # values sent to the next stage (empty on the last stage)
    relayed: tuple[str, ...]      # inputs passed on unchanged to the next stage (skips over this stage)


def check_ranges(ranges: Sequence[tuple[int, int]], n_nodes: int) -> None:
    """Ranges must be contiguous, non-empty and cover nodes 0..n_nodes-1 in order."""
    expected = 0
    for i, (first, last) in enumerate(ranges):
        if first != expected or last < first:
            raise UserError(f"stage {i} covers nodes {first}..{last} but must start at node {expected} and "
                            "not be empty (stages are contiguous node ranges); re-partition")
        expected = last + 1
    if expected != n_nodes:
        raise UserError(f"the stages cover {expected} nodes but the model has {n_nodes}: the plan was made "
                        "for another version of the model; re-profile and re-partition")


def stage_of_nodes(captured: CapturedModel, ranges: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Stage of every graph operation, model input and the output (by fx node name)."""
    check_ranges(ranges, len(captured.blocks))
    stage_of: dict[str, int] = {}
    for s, (first, last) in enumerate(ranges):
        for block in captured.blocks[first:last + 1]:
            for name in block.nodes:
                stage_of[name] = s
    for node in captured.graph.graph.nodes:
        if node.op == "placeholder" and node.name not in captured.constants:
            stage_of[node.name] = 0
        elif node.op == "output":
            stage_of[node.name] = len(ranges) - 1
    return stage_of


def stage_boundaries(captured: CapturedModel, ranges: Sequence[tuple[int, int]]) -> list[StageBoundary]:
    """The inputs and outputs of every stage when ``captured`` is cut at ``ranges`` (inclusive block ranges)."""
    stage_of = stage_of_nodes(captured, ranges)
    crossing: list[list[str]] = [[] for _ in ranges]   # crossing[c]: values crossing the cut after stage c
    for node in captured.graph.graph.nodes:
        if node.name not in stage_of or node.op == "output":
            continue
        readers = [stage_of[u.name] for u in node.users if u.name in stage_of]
        for c in range(stage_of[node.name], max(readers, default=-1)):
            crossing[c].append(node.name)
    model_inputs = tuple(n.name for n in captured.graph.graph.nodes if n.op == "placeholder" and n.name in stage_of)
    out = []
    for s, (first, last) in enumerate(ranges):
        inputs = tuple(crossing[s - 1]) if s else model_inputs
        outputs = tuple(crossing[s]) if s < len(ranges) - 1 else ()
        out.append(StageBoundary(s, first, last, inputs, outputs, tuple(v for v in inputs if v in outputs)))
    return out


def check_cuts(captured: CapturedModel, boundaries: Sequence[StageBoundary]) -> None:
    """Refuse (one line) a cut that a value which cannot travel between processes would cross."""
    for b in boundaries[:-1]:
        for name in b.outputs:
            if name in captured.blocked:
                block = next((blk.name for blk in captured.blocks if name in blk.nodes), "?")
                raise UserError(f"value {name!r} (computed in {block}) holds a {captured.blocked[name]}, which cannot "
                                f"be sent between stages, and the plan cuts after node {b.last_node} "
                                f"({captured.blocks[b.last_node].name}) while it is still needed; re-partition "
                                "(a profile of this model marks that cut infeasible) or make the model return "
                                "tensors there")


def stage_graph_module(captured: CapturedModel, boundary: StageBoundary, last: bool) -> fx.GraphModule:
    """A GraphModule computing one stage: positional inputs ``boundary.inputs``, returns a tuple of
    ``boundary.outputs`` (or, on the last stage, the model's flat output)."""
    gm = captured.graph
    members = {name for block in captured.blocks[boundary.first_node:boundary.last_node + 1] for name in block.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in boundary.inputs:
        env[by_name[name]] = graph.placeholder(name)

    def arg(n: fx.Node) -> Any:
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.node_copy(n)
            elif n.op == "placeholder" and n.name in captured.constants:
                env[n] = captured.constants[n.name]
            else:
                raise AssertionError(f"stage {boundary.index} reads {n.name!r}, which it neither computes nor receives")
        return env[n]

    result: Any = None
    for node in gm.graph.nodes:
        if node.op == "output" and last:
            result = fx.map_arg(node.args[0], arg)
        elif is_operation(node) and node.name in members:
            env[node] = graph.node_copy(node, arg)
    referenced = {str(n.target) for n in env.values() if isinstance(n, fx.Node) and n.op == "get_attr"}
    held = [*captured.block_params()[boundary.first_node:boundary.last_node + 1],
            *kept_buffers(captured)[boundary.first_node:boundary.last_node + 1]]
    for names in held:
        for name in names:
            if name not in referenced and not _in_called_module(gm, graph, name):
                _ensure_buffer(gm, captured.module, name)
                graph.get_attr(name)            # read by no operation: held (saved, restored), never used
                referenced.add(name)
    if last:
        graph.output(result)
    else:
        graph.output(tuple(arg(by_name[name]) for name in boundary.outputs))
    graph.lint()
    stage = fx.GraphModule(gm, graph, class_name=f"Stage{boundary.index}")
    _keep_buffers_transient(stage, captured.module)
    return stage


def _ensure_buffer(gm: fx.GraphModule, model: nn.Module, name: str) -> None:
    """Give the captured graph module the model's buffer ``name`` if its graph lost it (the same tensor)."""
    owner, _, local = name.rpartition(".")
    try:
        graph_attr(gm, name)                # a parameter, or a buffer the graph kept
        return
    except AttributeError:
        pass
    if owner:
        try:
            gm.get_submodule(owner)
        except AttributeError:
            gm.add_submodule(owner, nn.Module())
    gm.get_submodule(owner).register_buffer(local, model.get_buffer(name))


def _in_called_module(gm: fx.GraphModule, graph: fx.Graph, name: str) -> bool:
    """Whether parameter ``name`` belongs to a module that ``graph`` calls whole (a leaf)."""
    return any(n.op == "call_module" and name.startswith(f"{n.target}.") for n in graph.nodes)


def _keep_buffers_transient(stage: nn.Module, model: nn.Module) -> None:
    """Tensors the model does not save -- buffers registered with ``persistent=False`` (rotary
    frequencies), constants torch.export lifted out of forward (``lifted_tensor_0``) -- stay out of
    the stage's ``state_dict`` too, so stage state dicts merge into exactly the model's."""
    transient = {f"{prefix}.{b}" if prefix else b
                 for prefix, mod in model.named_modules() for b in mod._non_persistent_buffers_set}
    saved = {name for name, _ in model.named_buffers(remove_duplicate=False)} - transient
    for name, _ in list(stage.named_buffers(remove_duplicate=False)):
        if name not in saved:
            owner, _, local = name.rpartition(".")
            stage.get_submodule(owner)._non_persistent_buffers_set.add(local)
