"""What both ends of a lane remember of its metadata (see wire.py): per key kind and tensor count
the last announced tensors, as a :class:`Layout` (offsets, sizes, the signature a sender compares
its next frame with), computed once per announcement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hybridpipe.comm.p2p.wire import TensorMeta, describe, flat_layout, kind_of, payload_bytes


class Layout(NamedTuple):
    """A frame's tensors as the wire lays them out: computed once per (re-)announced metadata."""

    metas: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]        # flat_layout's
    body_bytes: int                 # flat_layout's length
    payload_bytes: int
    signature: tuple                # ((name, dtype, shape), ...): what a sender compares its tensors with


def layout_of(metas: tuple[TensorMeta, ...]) -> Layout:
    offsets, body = flat_layout(metas)
    return Layout(metas, offsets, body, payload_bytes(metas), tuple((m.name, m.dtype, m.shape) for m in metas))


class MetaCache:
    """Last metadata per key kind and tensor count on one lane direction (kept identical on both
    ends), with its :class:`Layout`: a kind whose frames alternate between two tensor counts (the
    step's last gradient frame carries the step's news, pipeline/stepnews.py) announces each once."""

    def __init__(self) -> None:
        self._by_kind: dict[tuple[str, int], Layout] = {}

    def sent(self, key: str, items: Sequence[tuple[str, torch.Tensor]]) -> tuple[Layout, bool]:
        """The layout of contiguous ``items`` sent under ``key``, and whether it differs from the one
        cached for ``key``'s kind and count (then remembered): an unchanged frame builds no metadata."""
        slot = (kind_of(key), len(items))
        known = self._by_kind.get(slot)
        if known is not None:
            for (name, t), (n, dtype, shape) in zip(items, known.signature, strict=True):    # the slot's count
                if name != n or t.dtype != dtype or t.shape != shape:
                    break
            else:
                return known, False
        self._by_kind[slot] = known = layout_of(describe(items))
        return known, True

    def update(self, key: str, metas: tuple[TensorMeta, ...]) -> None:
        self._by_kind[kind_of(key), len(metas)] = layout_of(metas)

    def layout(self, key: str, n_tensors: int) -> Layout | None:
        return self._by_kind.get((kind_of(key), n_tensors))
