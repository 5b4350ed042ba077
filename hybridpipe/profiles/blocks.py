"""Grouping a captured graph's operations into *blocks*: the nodes of a profile and of a plan.

A graph from torch.export has one node per aten operation (hundreds for a small transformer);
a cut may fall between any two of them, but a user reads, and the partitioner needs, layers. Every
operation records the stack of module calls it ran in (``node.meta["nn_module_stack"]``), so an
operation's *key* is a module path cut at the granularity asked for, and a block is a maximal run
of consecutive operations (graph order, a topological order) with the same key:

* ``blocks`` (default): the children of the model's outermost containers (``nn.ModuleList``,
  ``nn.Sequential``, ``nn.ModuleDict``) -- ``transformer.h.3``, ``model.layers.0``,
  ``encoder.layer.2``, ``features.0`` -- and, for modules outside them, the module that sits
  beside a container's ancestors (``transformer.wte``, ``transformer.ln_f``, ``lm_head``,
  ``bert.embeddings``, ``bert.pooler``). A model without containers is cut into its top-level
  children.
* ``modules``: the innermost module of each operation (a leaf module: ``Linear``, ``LayerNorm``).
* ``ops``: every operation its own block.
* an integer ``D``: module paths cut to ``D`` components (1: the model's top-level children).

Operations that run in an ancestor's own ``forward`` (glue code: masks, position ids, reshapes,
residual adds, an HF model's loss) have a key that is a strict prefix of other keys; such a run
joins the next block (the last one joins the previous block), so blocks are named after modules.
Modules whose class is in ``leaf_modules`` are never split further. Names are unique: a module
whose operations come in several separate runs gets ``name``, ``name#2``, ...
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import fx, nn

from hybridpipe.errors import UserError

GRANULARITIES = ("blocks", "modules", "ops")
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
GRAPH_INTERNAL = ("_guards_fn",)     # torch.export's own input checks: not part of the model


@dataclass(frozen=True)
class Block:
    """One profile node: consecutive graph operations under one module path."""

    name: str                     # the module path (unique: "name#2" for a module's second run)
    type: str                     # the module's class name; "ops" for code outside any module
    nodes: tuple[str, ...]        # fx node names of its operations, in graph order


def parse_granularity(text: str | int) -> str | int:
    """``blocks``, ``modules``, ``ops`` or a positive depth; a UserError otherwise."""
    if isinstance(text, int) or (isinstance(text, str) and text.isdigit()):
        depth = int(text)
        if depth < 1:
            raise UserError(f"--granularity depth must be >= 1, got {depth}")
        return depth
    if text not in GRANULARITIES:
        raise UserError(f"unknown --granularity {text!r}: use blocks, modules, ops or a module depth (1, 2, ...)")
    return text


def is_operation(node: fx.Node) -> bool:
    """Whether ``node`` computes something (not an input, parameter, output or export's guard)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    return not (node.op == "call_module" and str(node.target) in GRAPH_INTERNAL)


def module_path(node: fx.Node) -> str:
    """The innermost module call ``node`` ran in ("" for the model's own forward)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) for v in stack.values() if not str(v[0]).startswith("_") and str(v[0]) != "L['self']"]
    if node.op == "call_module" and not paths:
        return str(node.target)
    return paths[-1] if paths else ""


def group_blocks(gm: fx.GraphModule, model: nn.Module, granularity: str | int = "blocks",
                 leaf_modules: Iterable[type | str] = ()) -> list[Block]:
    """The blocks of ``gm`` (a capture of ``model``), in graph order; see the module docstring."""
    granularity = parse_granularity(granularity)
    keyer = _Keyer(model, granularity, tuple(leaf_modules))
    runs: list[tuple[str, list[str]]] = []
    for node in gm.graph.nodes:
        if not is_operation(node):
            continue
        key = node.name if granularity == "ops" else keyer.key(module_path(node))
        if runs and runs[-1][0] == key and granularity != "ops":
            runs[-1][1].append(node.name)
        else:
            runs.append((key, [node.name]))
    if not runs:
        raise UserError(f"{type(model).__name__}'s forward computes nothing: there is nothing to profile")
    runs = _merge_glue(runs) if granularity != "ops" else runs
    return _name(runs, model, gm, granularity)


class _Keyer:
    """Maps a module path to its block key at one granularity."""

    def __init__(self, model: nn.Module, granularity: str | int, leaf_modules: tuple[type | str, ...]):
        self.model, self.granularity = model, granularity
        self.containers = _outer_containers(model)
        self.leaves = _leaf_prefixes(model, leaf_modules)

    def key(self, path: str) -> str:
        parts = path.split(".") if path else []
        if self.granularity == "modules":
            cut = len(parts)
        elif isinstance(self.granularity, int):
            cut = min(len(parts), self.granularity)
        else:
            cut = self._block_depth(parts)
        for leaf in self.leaves:
            if parts[:len(leaf)] == leaf:
                cut = min(cut, len(leaf))
        return ".".join(parts[:cut])

    def _block_depth(self, parts: list[str]) -> int:
        if not self.containers:
            return min(len(parts), 1)
        best = 0
        for c in self.containers:
            if parts[:len(c)] == c and len(parts) > len(c):
                return len(c) + 1           # inside a container: its child is the block
            common = 0
            while common < min(len(c), len(parts)) and c[common] == parts[common]:
                common += 1
            best = max(best, common)
        return min(len(parts), best + 1)    # beside a container's ancestor


def _outer_containers(model: nn.Module) -> list[list[str]]:
    """Paths (as component lists) of the containers not nested inside another container's child."""
    if isinstance(model, CONTAINERS):
        return [[]]
    found: list[list[str]] = []

    def walk(module: nn.Module, prefix: list[str]) -> None:
        for name, child in module.named_children():
            if isinstance(child, CONTAINERS):
                found.append([*prefix, name])
            else:
                walk(child, [*prefix, name])

    walk(model, [])
    return found


def check_leaf_modules(model: nn.Module, leaf_modules: Iterable[type | str]) -> None:
    """A UserError naming a leaf module class name that no module of ``model`` has (a typo)."""
    present: set[str] = set()
    for m in model.modules():
        cls = type(m)
        present |= {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
    unknown = [x for x in leaf_modules if isinstance(x, str) and x not in present]
    if unknown:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise UserError(f"leaf module {unknown[0]!r} is not a module class of {type(model).__name__}; "
                        f"its classes are: {', '.join(classes)}")


def _leaf_prefixes(model: nn.Module, leaf_modules: tuple[type | str, ...]) -> list[list[str]]:
    if not leaf_modules:
        return []
    types = tuple(x for x in leaf_modules if isinstance(x, type))
    names = {x for x in leaf_modules if isinstance(x, str)}
    out = []
    for path, module in model.named_modules():
        cls = type(module)
        if path and (isinstance(module, types) or {cls.__name__, cls.__qualname__,
                                                    f"{cls.__module__}.{cls.__qualname__}"} & names):
            out.append(path.split("."))
    return out


def _merge_glue(runs: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Runs whose key is an ancestor of another run's key join the next run (the last: the previous)."""
    keys = {k for k, _ in runs}

    def glue(key: str) -> bool:
        return any(other != key and (key == "" or other.startswith(key + ".")) for other in keys)

    merged: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for key, nodes in runs:
        if glue(key):
            pending += nodes
            continue
        merged.append((key, pending + nodes))
        pending = []
    if pending:
        if merged:
            merged[-1][1].extend(pending)
        else:
            merged.append((runs[0][0], pending))
    return merged


def _name(runs: Sequence[tuple[str, list[str]]], model: nn.Module, gm: fx.GraphModule,
          granularity: str | int) -> list[Block]:
    seen: dict[str, int] = {}
    blocks = []
    by_name = {n.name: n for n in gm.graph.nodes}
    for key, nodes in runs:
        if granularity == "ops":
            path = module_path(by_name[key])
            base = f"{path}:{key}" if path else key
        else:
            base = key or "model"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        blocks.append(Block(name=name, type=_type_of(model, key if granularity != "ops" else ""), nodes=tuple(nodes)))
    return blocks


def _type_of(model: nn.Module, path: str) -> str:
    if not path:
        return "ops"
    try:
        return type(model.get_submodule(path)).__name__
    except AttributeError:
        return "ops"
