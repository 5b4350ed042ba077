"""What a profile records of a captured model's structure: its blocks as nodes, and the edges.

Node id = block index (``CapturedModel.blocks``), a topological order. Each node *owns* the
parameters it is the first to read; a parameter read by later nodes too (tied embeddings, a weight
reused by a head) is listed in those nodes' ``shared`` names: when such nodes land in different
stages, each stage holds a copy and the copies' gradients are summed every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpipe.profiles.capture import CapturedModel


@dataclass(frozen=True)
class NodeInfo:
    """What the profile records of a node's identity (no costs)."""

    name: str
    op: str                       # "module" (a block named after a module) or "ops" (code outside modules)
    target: str                   # the module path (the name without a "#k" suffix)
    type: str                     # the module's class name
    params: tuple[str, ...]       # parameters it owns (first reader), as the model names them
    shared: tuple[str, ...]       # parameters it reads that an earlier node owns (tied / reused weights)


def node_infos(captured: CapturedModel) -> list[NodeInfo]:
    """Identity of every block, in order; each parameter is owned by the first block that reads it."""
    model = captured.module
    canonical = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, int] = {}
    infos = []
    for i, (block, names) in enumerate(zip(captured.blocks, captured.block_params(), strict=True)):
        own, shared = [], []
        for name in names:
            p = model.get_parameter(name)
            if id(p) not in owner:
                owner[id(p)] = i
                own.append(canonical[id(p)])
            elif owner[id(p)] != i:
                shared.append(name)
        infos.append(NodeInfo(name=block.name, op="ops" if block.type == "ops" else "module",
                              target=block.name.split("#")[0], type=block.type, params=tuple(own),
                              shared=tuple(shared)))
    return infos


def block_of_values(captured: CapturedModel) -> dict[str, int]:
    """Block id of every graph operation (fx node name)."""
    return {name: i for i, block in enumerate(captured.blocks) for name in block.nodes}


def graph_edges(captured: CapturedModel) -> list[tuple[int, int]]:
    """Data edges ``(src, dst)`` between blocks: a value computed in ``src`` is read in ``dst``."""
    where = block_of_values(captured)
    edges = set()
    for node in captured.graph.graph.nodes:
        src = where.get(node.name)
        if src is None:
            continue
        for user in node.users:
            dst = where.get(user.name)
            if dst is not None and dst != src:
                edges.add((src, dst))
    return sorted(edges)


def unused_parameters(captured: CapturedModel) -> list[str]:
    """Parameters of the model that no block reads (no gradient; the stage of their nearest module
    keeps them: ``CapturedModel.block_params``)."""
    read = {id(captured.module.get_parameter(n)) for names in captured.read_params() for n in names}
    return [name for name, p in captured.module.named_parameters() if id(p) not in read]
