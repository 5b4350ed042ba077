"""Values that cross a stage boundary, as the flat ``{name: Tensor}`` dicts the transport carries.

A graph value is a tensor, a small Python value (an int such as ``x.size(0)``, a float, a bool,
None, a string, a dtype or device) or a tuple/list/dict of those, nested. ``pack`` flattens each
value with ``torch.utils._pytree``: tensor leaves travel as tensors under ``"v"`` (the value is a
tensor) or ``"v.0"``, ``"v.1"``, ... (its i-th leaf); the rest (the tree's structure and the
non-tensor leaves) travels as JSON in one uint8 tensor under ``"__meta__"``. ``unpack`` rebuilds
every value from the keys alone, so the receiving stage needs no shape or type information ahead
of time, and a new sequence length or batch size simply arrives with the next message. fx node
names never contain a dot, so the keys cannot collide.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hybridpipe.errors import UserError

META_KEY = "__meta__"


def pack(values: Mapping[str, Any], where: str = "") -> dict[str, torch.Tensor]:
    """Flatten named values into named tensors (plus one metadata tensor when needed)."""
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
            continue
        leaves, spec = pytree.tree_flatten(value)
        consts = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                out[f"{name}.{i}"] = leaf
            else:
                consts[str(i)] = _encode(name, leaf, where)
        meta[name] = {"spec": pytree.treespec_dumps(spec), "n": len(leaves), "consts": consts}
    if meta:
        out[META_KEY] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return out


def unpack(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, Any]:
    """Rebuild the values ``names`` from keys made by :func:`pack`; KeyError if one is missing."""
    meta = json.loads(bytes(tensors[META_KEY].cpu().numpy()).decode()) if META_KEY in tensors else {}
    out: dict[str, Any] = {}
    for name in names:
        if name in tensors:
            out[name] = tensors[name]
            continue
        if name not in meta:
            raise KeyError(f"value {name!r} is missing from the received tensors {sorted(tensors)}")
        m = meta[name]
        leaves = [_decode(m["consts"][str(i)]) if str(i) in m["consts"] else tensors[f"{name}.{i}"]
                  for i in range(m["n"])]
        out[name] = pytree.tree_unflatten(leaves, pytree.treespec_loads(m["spec"]))
    return out


def tensor_items(packed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed tensors without the metadata entry."""
    return {k: v for k, v in packed.items() if k != META_KEY}


def _encode(name: str, leaf: Any, where: str) -> Any:
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return {"v": leaf}
    if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"v": leaf.node.hint if hasattr(leaf, "node") else int(leaf)}
    if isinstance(leaf, torch.dtype):
        return {"dtype": str(leaf).removeprefix("torch.")}
    if isinstance(leaf, torch.device):
        return {"device": str(leaf)}
    raise UserError(f"graph value {name!r} crosses a stage boundary{where} but holds a {type(leaf).__name__}, "
                    "which cannot be sent between stages (only tensors and small Python values such as ints, "
                    "None or shape tuples can); re-partition so the cut falls elsewhere")


def _decode(item: dict[str, Any]) -> Any:
    if "dtype" in item:
        return getattr(torch, item["dtype"])
    if "device" in item:
        return torch.device(item["device"])
    return item["v"]


def moved(tree: Any, device: torch.device) -> Any:
    """``tree`` (a tensor, or tuples, lists and dicts of them, nested; None) with every tensor on
    ``device`` (a target as the data gives it)."""
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)
