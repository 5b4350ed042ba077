"""What a graph torch.export captured assumes of its inputs' shapes, as plain data, checked on every batch.

torch.export, asked for dynamic dimensions (``Dim.AUTO``), keeps a dimension dynamic only where the
model's code allows it: where the code computes from a size (TensorFlow "same" padding from an
image's height, a position table's length), the dimension is fixed to the example's size, or
bounded, and the graph computes the model only inside those bounds. ``ExportedProgram.module()``
checks them in a guard call the capture drops (hybridpipe feeds the graph flattened inputs
itself), so a batch outside them would run through the graph and silently compute something other
than the model (MobileNetV2 captured on 32x32 images and fed 33x33 ones pads as for 32: its weights
end thousands apart from one process's after 2 steps). :class:`InputShapes` keeps those bounds --
per input, each dimension a fixed size or a symbol that the dimensions which must be equal share,
and each symbol's range -- and :meth:`InputShapes.check` refuses a batch outside them in one line.
Relations export states otherwise (a product of two sizes) are not kept: sizes one dimension
shares with another are still checked equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from hybridpipe.errors import UserError

Dim = int | str | None       # a fixed size, a symbol, or None (an expression: not checked)


@dataclass(frozen=True)
class InputShapes:
    """Per graph input (placeholder name), each dimension: a fixed size, a symbol, or None; per
    symbol its (lowest, highest) size, highest None for no bound; ``paths``: where each input sits
    in the batch (for messages)."""

    dims: Mapping[str, tuple[Dim, ...]]
    ranges: Mapping[str, tuple[int, int | None]]
    paths: Mapping[str, str]

    def check(self, values: Mapping[str, Any]) -> None:
        """Refuse (UserError, one line) a batch whose tensors' shapes the graph was not captured for."""
        seen: dict[str, tuple[int, str]] = {}
        for name, dims in self.dims.items():
            value = values.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            where = f"the input at {self.paths.get(name, name)}"
            if value.dim() != len(dims):
                raise UserError(f"{where} has {value.dim()} dimensions ({list(value.shape)}), the model was captured "
                                f"with {len(dims)}; feed batches shaped like the example input")
            for i, (size, dim) in enumerate(zip(value.shape, dims, strict=True)):
                size = int(size)
                if isinstance(dim, int) and size != dim:
                    raise UserError(f"{where} has size {size} in dimension {i} ({list(value.shape)}), but the model's "
                                    f"code fixed that dimension to the example's {dim} when it was captured (it "
                                    "computes from that size), so its graph would compute something else; feed "
                                    f"batches of size {dim} there, or capture the model on an example of this size")
                if isinstance(dim, str):
                    low, high = self.ranges.get(dim, (0, None))
                    if size < low or (high is not None and size > high):
                        bound = f"{low}..{high}" if high is not None else f"at least {low}"
                        raise UserError(f"{where} has size {size} in dimension {i} ({list(value.shape)}), but the "
                                        f"model's graph was captured for sizes {bound} there (its code branches on "
                                        "that size); feed batches within those sizes")
                    first = seen.setdefault(dim, (size, f"{where}'s dimension {i}"))
                    if first[0] != size:
                        raise UserError(f"{where} has size {size} in dimension {i} but {first[1]} has {first[0]}; the "
                                        "model's graph needs them equal, as in the example input")

    def to_json(self) -> dict:
        return {"dims": {k: list(v) for k, v in self.dims.items()},
                "ranges": {k: list(v) for k, v in self.ranges.items()}, "paths": dict(self.paths)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> InputShapes:
        def dim(d: Any) -> Dim:
            if d is None or isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool)):
                return d
            raise ValueError(f"not a dimension: {d!r}")

        def bound(b: Any) -> int | None:
            if b is None or (isinstance(b, int) and not isinstance(b, bool)):
                return b
            raise ValueError(f"not a size bound: {b!r}")

        return cls(dims={str(k): tuple(dim(d) for d in v) for k, v in record["dims"].items()},
                   ranges={str(k): (int(v[0]), bound(v[1])) for k, v in record["ranges"].items()},
                   paths={str(k): str(v) for k, v in record["paths"].items()})


def input_shapes(gm: fx.GraphModule, range_constraints: Mapping[Any, Any], paths: Mapping[str, str]) -> InputShapes:
    """The shapes ``gm`` (``ExportedProgram.module()``) was captured for: each placeholder's traced
    value's sizes (an integer where export fixed the size, a symbol where it kept it dynamic) and
    the symbols' ranges from ``range_constraints``."""
    dims: dict[str, tuple[Dim, ...]] = {}
    used: set[str] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        out: list[Dim] = []
        for size in value.shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else int(size)
            if isinstance(expr, int) or getattr(expr, "is_Integer", False):
                out.append(int(expr))
            elif getattr(expr, "is_Symbol", False):
                out.append(str(expr))
                used.add(str(expr))
            else:
                out.append(None)
        dims[node.name] = tuple(out)
    ranges: dict[str, tuple[int, int | None]] = {}
    for symbol, vr in range_constraints.items():
        if str(symbol) in used:
            lower, upper = vr.lower, vr.upper
            ranges[str(symbol)] = (int(lower) if getattr(lower, "is_Integer", False) else 0,
                                   int(upper) if getattr(upper, "is_Integer", False) else None)
    return InputShapes(dims=dims, ranges=ranges, paths=dict(paths))
