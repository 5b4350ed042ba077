"""The captured model (profiles/capture.py makes it): the graph, its blocks, how to feed it, and
what its operations read (parameters, values that cannot cross a stage boundary)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.blocks import Block
from hybridpipe.profiles.calling import call_args
from hybridpipe.profiles.export_support import first_line
from hybridpipe.profiles.input_shapes import InputShapes

_META = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass
class CapturedModel:
    """A model's captured graph, its blocks, and how to feed it (profiles/capture.py makes it)."""

    module: nn.Module                       # the user's model (its parameters are the graph's)
    graph: fx.GraphModule
    blocks: tuple[Block, ...]
    inputs: tuple[str, ...]                 # placeholder names, in the order of the flattened input
    input_paths: tuple[str, ...]            # each placeholder's place in the input (pytree key path)
    constants: dict[str, Any]               # placeholders fed a constant (use_cache=False, defaults)
    out_spec: pytree.TreeSpec | None        # rebuilds the model's output from the graph's flat output
    blocked: dict[str, str] = field(default_factory=dict)   # value -> type that cannot cross a cut
    front_end: str = "export"
    example_values: dict[str, Any] | None = None            # fx only: every value for the example
    autocast: torch.dtype | None = None                     # captured (and to run) under torch.autocast to it
    input_shapes: InputShapes | None = None                 # the shapes export captured the graph for (checked)
    input_guards: Callable[..., Any] | None = None          # export's own check of them (all placeholders)

    # ---- inputs and outputs ------------------------------------------------------------
    def flatten_input(self, batch: Any, *, check: bool = True) -> dict[str, Any]:
        """Placeholder name -> value for one batch shaped like the example (tensor, tuple or dict); its
        shapes checked against what the graph was captured for (``check=False``: for a caller that splits
        the flattened values into batches of the captured shapes before any reaches the graph)."""
        args, kwargs = call_args(batch)
        leaves = {pytree.keystr(path): v for path, v in pytree.tree_flatten_with_path((args, kwargs))[0]}
        out = {}
        for name, path in zip(self.inputs, self.input_paths, strict=True):
            if name in self.constants:
                out[name] = self.constants[name]
            elif path in leaves:
                out[name] = leaves[path]
            else:
                expected = [p for n, p in zip(self.inputs, self.input_paths, strict=True) if n not in self.constants]
                raise UserError(f"the batch has no input at {path} (the model was captured with inputs at "
                                f"{', '.join(expected)}); feed batches shaped like the example input")
        if check and self.input_shapes is not None:
            self.input_shapes.check(out)
        if check and self.input_guards is not None:
            try:
                self.input_guards(*out.values())
            except AssertionError as e:
                raise UserError(f"the batch's shapes break what the model's graph was captured for ({first_line(e)}: "
                                "the model's code branched on that size when torch.export captured it, so its graph "
                                "would compute something else); feed batches that meet it, or capture the model on "
                                "an example of these shapes") from None
        return out

    def rebuild_output(self, flat: Any) -> Any:
        """The model's output as its forward returns it, from the graph's flat output."""
        if self.out_spec is None:
            return flat
        leaves = list(flat) if isinstance(flat, (tuple, list)) else [flat]
        return pytree.tree_unflatten(leaves, self.out_spec)

    # ---- parameters ----------------------------------------------------------------------
    def read_params(self) -> list[tuple[str, ...]]:
        """For every block, the parameter names (as the graph refers to them) its operations read."""
        nodes = {n.name: n for n in self.graph.graph.nodes}
        out = []
        for block in self.blocks:
            names: list[str] = []
            for node_name in block.nodes:
                for p in node_parameters(self.graph, nodes[node_name]):
                    if p not in names:
                        names.append(p)
            out.append(tuple(names))
        return out

    def block_params(self) -> list[tuple[str, ...]]:
        """For every block, the parameters it reads (:meth:`read_params`) and those of the model
        that no block reads (the forward never uses them: BartForCausalLM's cross-attention), each
        held by the block of its nearest module (the longest common module path; the first on a tie),
        so that a stage keeps, saves and restores them unchanged, as one process does."""
        read = self.read_params()
        seen = {id(self.graph.get_parameter(n)) for names in read for n in names}
        kept: list[list[str]] = [[] for _ in self.blocks]
        for name, p in self.graph.named_parameters():
            if id(p) not in seen and self.blocks:
                seen.add(id(p))
                kept[_nearest_block(name, self.blocks)].append(name)
        return [names + tuple(more) for names, more in zip(read, kept, strict=True)]


def unsendable(value: Any) -> str | None:
    """None if ``value`` can cross a stage boundary (tensors and small Python constants, nested in
    tuples, lists and dicts), else the name of the type that cannot."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) or isinstance(leaf, _META):
            continue
        if isinstance(leaf, torch.Size):
            continue
        return type(leaf).__name__
    return None


def node_parameters(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """Qualified names of the parameters ``node`` reads (get_attr inputs, or a called module's)."""
    out = []
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        out += [f"{node.target}.{name}" for name, _ in mod.named_parameters(remove_duplicate=False)]
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and isinstance(graph_attr(gm, str(arg.target)), nn.Parameter):
            out.append(str(arg.target))
    return out


def kept_buffers(captured: CapturedModel) -> list[tuple[str, ...]]:
    """For every block, the saved buffers of the model that no operation reads, each held by the
    block of its nearest module as :meth:`CapturedModel.block_params` holds unused parameters."""
    gm = captured.graph
    nodes = {n.name: n for n in gm.graph.nodes}
    read: set[str] = set()
    for node in (nodes[name] for block in captured.blocks for name in block.nodes):
        read.update(str(a.target) for a in node.all_input_nodes if a.op == "get_attr")
        if node.op == "call_module":
            read.update(f"{node.target}.{b}" for b, _ in gm.get_submodule(str(node.target)).named_buffers())
    saved = set(captured.module.state_dict(keep_vars=True))
    kept: list[list[str]] = [[] for _ in captured.blocks]
    for name, _ in captured.module.named_buffers():     # torch.export leaves unread buffers out of its graph
        if name in saved and name not in read and captured.blocks:
            kept[_nearest_block(name, captured.blocks)].append(name)
    return [tuple(names) for names in kept]


def _nearest_block(name: str, blocks: tuple[Block, ...]) -> int:
    """The block whose module path shares the most leading parts with parameter ``name``'s."""
    parts = name.split(".")

    def common(block: Block) -> int:
        n = 0
        for a, b in zip(parts, block.name.split("#")[0].split("."), strict=False):
            if a != b:
                break
            n += 1
        return n
    return max(range(len(blocks)), key=lambda i: (common(blocks[i]), -i))


def graph_attr(gm: nn.Module, target: str) -> Any:
    """The attribute of ``gm`` at the dotted ``target`` (a get_attr node's parameter or buffer)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names under which one parameter object is registered (tied weights), model order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(v) for v in names.values() if len(v) > 1]
