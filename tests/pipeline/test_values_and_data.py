"""Packing graph values into named tensors, and addressing micro-batches in a dataset."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.pipeline.values import pack, unpack

tensor = st.integers(1, 4).map(lambda n: torch.randn(n))
small = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                  st.text(max_size=5), st.sampled_from([torch.float16, torch.int64]),
                  st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)]))
leaf = st.one_of(tensor, tensor, small)
nested = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(tuple), st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=3)), max_leaves=8)


def same(a, b) -> bool:
    """Equal values of the same types, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@given(values=st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), nested, min_size=1, max_size=4))
def test_pack_then_unpack_gives_the_values_back(values):
    """Tensors, small Python values (ints such as x.size(0), None, dtypes, ...) and tuples, lists and
    dicts of them come back as they were; only tensors travel as tensors, the rest as metadata."""
    packed = pack(values)
    assert all(isinstance(t, torch.Tensor) for t in packed.values())
    back = unpack(packed, values)
    assert all(same(values[k], back[k]) for k in values)
    sent = [t for k, t in packed.items() if k != "__meta__"]
    assert len(sent) == sum(isinstance(x, torch.Tensor) for v in values.values() for x in pytree.tree_leaves(v))


def test_a_value_that_cannot_travel_and_missing_names_are_errors():
    class Cache:
        pass

    assert unpack(pack({"n": 3}), ["n"]) == {"n": 3} and set(pack({"n": 3})) == {"__meta__"}
    with pytest.raises(UserError, match="'c' crosses a stage boundary between stages 1 and 2 but holds a Cache"):
        pack({"c": (torch.zeros(1), Cache())}, " between stages 1 and 2")
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


class Ragged:
    """Token sequences of different lengths; ``collate_fn`` pads a batch to its longest one."""

    def __init__(self, lengths):
        self.items = [torch.arange(1, n + 1) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return {"ids": self.items[i]}

    @staticmethod
    def collate_fn(samples):
        ids = torch.nn.utils.rnn.pad_sequence([s["ids"] for s in samples], batch_first=True)
        return {"ids": ids, "mask": (ids != 0).long()}


def test_micro_batches_are_collated_by_the_datasets_own_collate_fn():
    mb = MicroBatches(Ragged([2, 5, 3, 3, 1, 4]), batch_size=2, micro_batches=3, targets=False)
    shapes = [tuple(mb.input(0, m)["ids"].shape) for m in range(3)]
    assert shapes == [(2, 5), (2, 3), (2, 4)] and mb.target(0, 1) is None
    assert mb.input(0, 0)["mask"].sum().item() == 7 and mb.input(0, 2)["ids"][0].tolist() == [1, 0, 0, 0]
