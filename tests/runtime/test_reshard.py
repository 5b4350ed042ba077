"""Plan-independent optimizer state (runtime/reshard.py), checked against the unsplit model: an
optimizer split by name into other "stages" continues exactly as the unsplit one would."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import atomic_save, load_data
from hybridpipe.runtime.reshard import (
    canonical_names,
    canonical_state,
    indexed_optimizer_state,
    merge_named,
    named_optimizer_state,
    optimizer_names,
    pick,
    restrict_named,
)


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3))


def make(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return (torch.optim.Adam(params, lr=0.01) if kind == "adam"
            else torch.optim.SGD(params, lr=0.05, momentum=0.9))


def step(modules, optimizers, x: torch.Tensor) -> None:
    for opt in optimizers:
        opt.zero_grad()
    y = x
    for m in modules:
        y = m(y)
    (y ** 2).mean().backward()
    for opt in optimizers:
        opt.step()


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_optimizer_state_moves_by_name_into_another_split_and_continues_exactly(kind, tmp_path):
    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    whole = model()
    opt = make(kind, whole.parameters())
    for x in xs[:3]:
        step([whole], [opt], x)
    # "stage" A = layers 0..1, B = layers 2..4 wrote their parts by name; the new split is 0..2 | 3..4
    names = optimizer_names(opt, whole, {})
    named = named_optimizer_state(opt.state_dict(), names)
    file = tmp_path / "part.pt"
    atomic_save({"a": restrict_named(named, ["0.weight", "0.bias"]),
                 "b": restrict_named(named, ["2.weight", "2.bias", "4.weight", "4.bias"])}, file)
    parts = load_data(file)                                 # plain data: weights_only=True round trip
    split = model()
    split.load_state_dict(whole.state_dict())
    first, second = split[:3], split[3:]
    new_opts = []
    for part in (first, second):
        o = make(kind, part.parameters())
        wanted = optimizer_names(o, part, {})
        o.load_state_dict(indexed_optimizer_state(merge_named([parts["a"], parts["b"]]), wanted, o.state_dict()))
        new_opts.append(o)
    for x in xs[3:]:
        step([whole], [opt], x)
        step([first, second], new_opts, x)
    for (k, a), b in zip(whole.state_dict().items(), split.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_tied_names_collapse_to_the_first_and_missing_names_are_one_line():
    canon = canonical_names([("wte.weight", "head.weight")])
    w = torch.ones(2)
    assert canonical_state({"head.weight": w, "x": w}, canon).keys() == {"wte.weight", "x"}
    assert pick({"wte.weight": "stage-0.pt", "x": "stage-1.pt"}, ["x", "wte.weight"]) == {
        "stage-1.pt": ["x"], "stage-0.pt": ["wte.weight"]}
    with pytest.raises(UserError, match="holds no 'y' .* another model"):
        pick({"x": "stage-0.pt"}, ["x", "y"])
    with pytest.raises(UserError, match="no optimizer state for 'z'"):
        indexed_optimizer_state({"state": {}, "param_groups": [{"params": ["x"]}]}, ["x", "z"],
                                {"state": {}, "param_groups": [{"params": [0, 1]}]})
