"""Packing graph values into named tensors, and addressing micro-batches in a dataset."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.pipeline.values import pack, unpack

leaf = st.integers(1, 4).map(lambda n: torch.randn(n))
nested = st.recursive(leaf, lambda inner: st.lists(inner, min_size=1, max_size=3).map(tuple), max_leaves=8)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


@given(values=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), nested, min_size=1, max_size=4))
def test_pack_then_unpack_gives_the_values_back(values):
    packed = pack(values)
    assert all(isinstance(t, torch.Tensor) for t in packed.values())
    back = unpack(packed, values)
    assert all(same(values[k], back[k]) for k in values)


def test_non_tensor_values_and_missing_names_are_errors():
    with pytest.raises(UserError, match="'n' crosses a stage boundary between stages 1 and 2 but holds a int"):
        pack({"n": 3}, " between stages 1 and 2")
    with pytest.raises(KeyError, match="'y' is missing"):
        unpack({"x": torch.zeros(1)}, ["y"])


def test_micro_batches_cover_the_step_in_order_and_wrap_around():
    data = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(10)]
    mb = MicroBatches(data, batch_size=2, micro_batches=3)
    assert mb.indices(0, 0) == [0, 1] and mb.indices(0, 2) == [4, 5] and mb.indices(1, 1) == [8, 9]
    assert mb.indices(1, 2) == [0, 1]                       # past the end: the next epoch
    x, y = mb.global_batch(1)
    assert x.flatten().tolist() == [6, 7, 8, 9, 0, 1] and y.tolist() == [6, 7, 8, 9, 0, 1]
    assert torch.equal(mb.input(0, 1), torch.tensor([[2.0], [3.0]])) and mb.target(0, 1).tolist() == [2, 3]
    with pytest.raises(ValueError):
        MicroBatches(data, batch_size=0, micro_batches=1)
