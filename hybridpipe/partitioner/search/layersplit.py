"""Layer-count splits of a transformer as torchtitan and Megatron-LM make them (``--strategy torchtitan|megatron``).

Both count transformer layers, not time: a model is its input modules (the embedding), a stack of
L repeated layers, and its output modules (final norm, LM head, loss), and each rule gives every
stage a number of layers, the first stage also the input modules, the last one the output modules.

* ``torchtitan`` (torchtitan's ``generate_llm_fqn_per_model_part``, its ``pipeline_parallel_first/
  last_stage_less_layers``, both 1 by default): the input modules weigh ``first`` layers and the
  output modules ``last`` layers; the E = L + first + last "effective" layers are dealt out E // S
  per stage, the E % S left over one each to the first stages, and the first stage then holds
  ``first`` fewer real layers, the last stage ``last`` fewer. Refused as torchtitan refuses: more
  stages than E, or a weight above E // S.
* ``megatron`` (Megatron-LM's ``account_for_embedding_in_pipeline_split`` and
  ``account_for_loss_in_pipeline_split``, both on): the embedding and the loss each count as one
  layer; the L + 2 layers must divide evenly over the S stages (Megatron's check), each stage
  builds (L + 2) / S of them, the first one fewer (the embedding's place), the last one fewer (the loss's).

The stack is found from the profile's node names (``find_stack``): the longest run of nodes named
``PREFIX.K...`` for increasing K (``model.layers.0``, ``model.layers.1``, ...); the nodes before it
are the input modules, the nodes after it the output ones. A profile without such a run (a model
with no numbered layers) is read as one input node, one output node and a layer per node between.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.errors import UserError

LAYER_SPLITS = ("torchtitan", "megatron")
_NUMBERED = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass(frozen=True)
class Stack:
    """A model read as input nodes, a stack of layers, output nodes (counts of profile nodes)."""

    before: int                    # nodes before the first layer (the embedding, ...)
    layers: tuple[int, ...]        # nodes of each layer, in order
    after: int                     # nodes after the last layer (norm, head, loss)
    prefix: str | None             # the layers' common name (``model.layers``); None: guessed, no numbered run


def _numbered(name: str) -> tuple[str, int] | None:
    """(prefix, index) of a node named ``PREFIX.K`` or ``PREFIX.K.rest`` (the outermost number)."""
    m = _NUMBERED.search(name)
    if m is None:
        return None
    return name[:max(m.start(), 0)], int(m.group(1))


def find_stack(names: Sequence[str]) -> Stack:
    """The stack of repeated layers in nodes named ``names`` (see the module docstring).

    Among prefixes whose numbered nodes come in one run of non-decreasing indices, the one with the
    most distinct indices (at least 2; ties to the earlier) is the stack; a node inside the run that
    is not numbered with it belongs to the layer before it (glue between layers)."""
    tagged = [_numbered(n) for n in names]
    best: tuple[int, str, int, int] | None = None          # (layers, prefix, first node, last node)
    for prefix in dict.fromkeys(t[0] for t in tagged if t is not None):
        at = [k for k, t in enumerate(tagged) if t is not None and t[0] == prefix]
        indices = [tagged[k][1] for k in at]                # type: ignore[index]
        if any(b < a for a, b in itertools.pairwise(indices)):
            continue
        count = len(set(indices))
        if count >= 2 and (best is None or count > best[0]):
            best = (count, prefix, at[0], at[-1])
    n = len(names)
    if best is None:
        if n < 2:
            raise UserError("a layer-count split needs a model of at least 2 nodes (input and output); "
                            "use --strategy optimal")
        return Stack(1, (1,) * (n - 2), 1, None)
    _, prefix, first, last = best
    sizes: list[int] = []
    current: int | None = None
    for k in range(first, last + 1):
        t = tagged[k]
        if t is not None and t[0] == prefix and t[1] != current:
            sizes.append(1)
            current = t[1]
        else:
            sizes[-1] += 1
    return Stack(first, tuple(sizes), n - 1 - last, prefix)


def torchtitan_layers(stages: int, layers: int, first: int = 1, last: int = 1) -> list[int]:
    """Transformer layers per stage under torchtitan's rule (module docstring); UserError where it refuses."""
    if stages < 1:
        raise UserError(f"a pipeline needs at least 1 stage, got {stages}")
    if stages == 1:
        return [layers]
    effective = layers + first + last
    if stages > effective:
        raise UserError(f"--strategy torchtitan: {stages} stages are more than the {effective} effective layers "
                        f"({layers} layers + {first} for the input + {last} for the output); use fewer stages")
    per, extra = divmod(effective, stages)
    if first > per or last > per:
        raise UserError(f"--strategy torchtitan: the input/output weigh {first}/{last} layers, more than the "
                        f"{per} layers a stage gets ({layers} layers over {stages} stages); use fewer stages")
    counts = [per + (1 if k < extra else 0) for k in range(stages)]
    counts[0] -= first
    counts[-1] -= last
    return counts


def megatron_layers(stages: int, layers: int, embedding: bool = True, loss: bool = True) -> list[int]:
    """Transformer layers per stage under Megatron-LM's rule (module docstring); UserError where it refuses."""
    if stages < 1:
        raise UserError(f"a pipeline needs at least 1 stage, got {stages}")
    total = layers + int(embedding) + int(loss)
    if total % stages:
        fits = [s for s in range(1, total + 1) if total % s == 0]
        raise UserError(f"--strategy megatron: {layers} layers + the embedding and the loss = {total} must divide "
                        f"evenly over the stages (Megatron's rule), not over {stages}; use --stages or --workers "
                        f"giving one of {', '.join(map(str, fits))} stages, or --strategy torchtitan")
    per = total // stages
    counts = [per] * stages
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    if min(counts) < 0:
        raise UserError(f"--strategy megatron: {stages} stages leave the first or last with no room for the "
                        "embedding or the loss; use fewer stages")
    return counts


def layer_split_sizes(strategy: str, names: Sequence[str], stages: int) -> list[int]:
    """Profile nodes per stage of ``strategy`` (``torchtitan`` or ``megatron``) over ``stages`` stages."""
    stack = find_stack(names)
    if strategy == "torchtitan":
        counts = torchtitan_layers(stages, len(stack.layers))
    elif strategy == "megatron":
        counts = megatron_layers(stages, len(stack.layers))
    else:
        raise UserError(f"unknown layer-count split {strategy!r}; choose from {', '.join(LAYER_SPLITS)}")
    return stage_node_counts(stack, counts)


def stage_node_counts(stack: Stack, counts: Sequence[int]) -> list[int]:
    """Nodes per stage when stage k holds ``counts[k]`` layers, the first also the input nodes and the last
    the output nodes; UserError when a stage would hold no node."""
    sizes, layer = [], 0
    for k, count in enumerate(counts):
        size = sum(stack.layers[layer:layer + count])
        layer += count
        size += stack.before if k == 0 else 0
        size += stack.after if k == len(counts) - 1 else 0
        sizes.append(size)
    if layer != len(stack.layers):
        raise ValueError(f"the counts {list(counts)} do not add up to {len(stack.layers)} layers")
    if min(sizes) == 0:
        empty = sizes.index(0)
        raise UserError(f"this layer-count split leaves stage {empty} without a node ({list(counts)} layers per stage "
                        f"of {len(stack.layers)}); use fewer stages or --strategy optimal")
    return sizes
