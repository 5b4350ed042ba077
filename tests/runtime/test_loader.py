"""runtime/loader.py: each replica loads only its micro-batches; an epoch's samples are read once."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from hybridpipe.errors import UserError
from hybridpipe.runtime.loader import StepLoader, epoch_order


class Numbered(Dataset):
    """Sample i = (i, 1000 + i), counting every fetch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.fetched.append(i)
        return torch.tensor(i), torch.tensor(1000 + i)


def loaders(data, replicas: int, *, first: bool, last: bool, B=2, M=6, epoch=0, workers=0, start=0):
    return [StepLoader(data, batch_size=B, micro_batches=M, mine=[m for m in range(M) if m % replicas == j],
                       inputs=first, targets=last, pairs=True, seed=7, epoch=epoch, num_workers=workers, start=start)
            for j in range(replicas)]


@pytest.mark.parametrize("replicas,workers", [(1, 0), (2, 0), (3, 2)])
def test_every_sample_of_an_epoch_is_read_once_across_the_first_stages_replicas(replicas, workers):
    data = Numbered(50)                                       # 4 steps of 12, 2 samples dropped
    order = epoch_order(50, seed=7, epoch=0, shuffle=True)
    seen: dict[tuple[int, int], list[int]] = {}
    for loader in loaders(data, replicas, first=True, last=False, workers=workers):
        assert len(loader) == 4
        for k, part in enumerate(loader):
            assert part is not None and part.targets is None
            for m, x in part.inputs.items():
                seen[(k, m)] = x.tolist()
    assert sorted(seen) == [(k, m) for k in range(4) for m in range(6)]
    assert [i for key in sorted(seen) for i in seen[key]] == order[:48]     # one process's order, once each
    if workers == 0:
        assert sorted(data.fetched) == sorted(order[:48])                    # nothing loaded twice


def test_the_last_stage_reads_the_targets_of_the_same_samples_and_middle_stages_read_nothing():
    data = Numbered(24)
    firsts = [{m: x.tolist() for m, x in part.inputs.items()} for part in loaders(data, 2, first=True, last=False)[1]]
    lasts = [{m: y.tolist() for m, y in part.targets.items()} for part in loaders(data, 2, first=False, last=True)[1]]
    assert [{m: [i + 1000 for i in x] for m, x in step.items()} for step in firsts] == lasts
    assert list(firsts[0]) == [1, 3, 5]                         # replica 1's micro-batches
    middle = loaders(data, 1, first=False, last=False)[0]
    fetched = len(data.fetched)
    assert list(middle) == [None, None] and len(data.fetched) == fetched


def test_epochs_shuffle_differently_and_a_too_small_dataset_is_refused():
    assert epoch_order(20, seed=1, epoch=0, shuffle=True) != epoch_order(20, seed=1, epoch=1, shuffle=True)
    assert epoch_order(5, seed=1, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="fewer than one step's 12"):
        loaders(Numbered(5), 1, first=True, last=False)


def test_a_loader_started_inside_an_epoch_yields_the_rest_of_it_and_loads_nothing_before():
    """A run resumed after step 2 of an epoch of 4 (``start=2``): the steps the uninterrupted run's
    loader yields third and fourth, and nothing of the first two is read."""
    whole = [{m: x.tolist() for m, x in part.inputs.items()} for part in loaders(Numbered(50), 2, first=True,
                                                                                   last=False, epoch=1)[1]]
    data = Numbered(50)
    [rest] = loaders(data, 2, first=True, last=False, epoch=1, start=2)[1:]
    assert len(rest) == 2
    assert [{m: x.tolist() for m, x in part.inputs.items()} for part in rest] == whole[2:]
    assert sorted(data.fetched) == sorted(i for step in whole[2:] for x in step.values() for i in x)
    assert len(loaders(Numbered(50), 1, first=True, last=False, start=4)[0]) == 0
    with pytest.raises(UserError, match="start must be >= 0"):
        loaders(Numbered(50), 1, first=True, last=False, start=-1)
