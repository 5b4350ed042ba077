"""Values that cross a stage boundary, as the flat ``{name: Tensor}`` dicts the transport carries.

A graph value is a tensor, or a tuple/list of them (``chunk`` returns one); nested tuples are
allowed. ``pack`` flattens value ``v`` into keys ``"v"`` (a tensor) or ``"v.0"``, ``"v.1"``, ...
(elements, recursively ``"v.0.1"``); ``unpack`` rebuilds the value from the keys alone, so the
receiving stage needs no shape or type information ahead of time. fx node names never contain
a dot, so the keys cannot collide.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hybridpipe.errors import UserError


def pack(values: Mapping[str, Any], where: str = "") -> dict[str, torch.Tensor]:
    """Flatten named values (tensors or nested tuples/lists of tensors) into named tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        _pack_one(name, value, out, where)
    return out


def _pack_one(key: str, value: Any, out: dict[str, torch.Tensor], where: str) -> None:
    if isinstance(value, torch.Tensor):
        out[key] = value
    elif isinstance(value, (tuple, list)) and value:
        for i, item in enumerate(value):
            _pack_one(f"{key}.{i}", item, out, where)
    else:
        node = key.split(".", 1)[0]
        raise UserError(f"graph value {node!r} crosses a stage boundary{where} but holds a "
                        f"{type(value).__name__}, not tensors; only tensors (or tuples of them) can be sent "
                        "between stages: re-partition so the cut falls elsewhere, or mark the module that "
                        "computes it as a leaf (--leaf ClassName) before profiling")


def unpack(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, Any]:
    """Rebuild the values ``names`` from keys made by :func:`pack`; error if one is missing."""
    out: dict[str, Any] = {}
    for name in names:
        if name in tensors:
            out[name] = tensors[name]
            continue
        prefix = name + "."
        parts = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        if not parts:
            raise KeyError(f"value {name!r} is missing from the received tensors {sorted(tensors)}")
        out[name] = _rebuild(parts)
    return out


def _rebuild(parts: dict[str, torch.Tensor]) -> tuple:
    heads: dict[int, dict[str, torch.Tensor]] = {}
    leaves: dict[int, torch.Tensor] = {}
    for rest, t in parts.items():
        head, _, tail = rest.partition(".")
        if tail:
            heads.setdefault(int(head), {})[tail] = t
        else:
            leaves[int(head)] = t
    n = max([*heads, *leaves]) + 1
    return tuple(leaves[i] if i in leaves else _rebuild(heads[i]) for i in range(n))
