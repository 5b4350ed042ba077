"""Plan-independent optimizer state (runtime/reshard.py), checked against the unsplit model: an
optimizer split by name into other "stages" continues exactly as the unsplit one would."""

from __future__ import annotations

import copy

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


def test_resumed_state_brings_back_the_hyperparameters_a_scheduler_moved():
    """A scheduler may move more than the learning rate (OneCycleLR cycles Adam's beta1; a user may set a
    group's weight decay): resuming restores every param group's hyperparameters as torch's own
    ``load_state_dict`` does, so the resumed run continues bitwise (before: the new optimizer's own,
    OneCycleLR's step-0 beta1 0.95 for 0.904, and 2.0e-2 apart after 3 more steps), while a new run
    from the state (``--init-from``) keeps its own; groups regrouped across hyperparameters are one line."""
    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(k)) for k in range(6)]

    def build(m):
        decay = [p for p in m.parameters() if p.ndim > 1]
        other = [p for p in m.parameters() if p.ndim == 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                lr=0.01)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=6)
    whole = model()
    opt, sched = build(whole)
    for x in xs[:3]:
        step([whole], [opt], x)
        sched.step()
    named = copy.deepcopy(named_optimizer_state(opt.state_dict(), optimizer_names(opt, whole, {})))   # as if read
    again = model()
    again.load_state_dict(whole.state_dict())
    new, new_sched = build(again)
    new_sched.load_state_dict(sched.state_dict())
    fresh = new.state_dict()
    names = optimizer_names(new, again, {})
    new.load_state_dict(indexed_optimizer_state(named, names, fresh, saved_hyperparameters=True))
    kept = indexed_optimizer_state(named, names, fresh)
    assert [g["betas"] for g in kept["param_groups"]] == [(0.95, 0.999)] * 2          # init-from: its own
    assert [g["betas"] for g in new.param_groups] == [g["betas"] for g in opt.param_groups] != kept["param_groups"]
    for x in xs[3:]:
        step([whole], [opt], x)
        sched.step()
        step([again], [new], x)
        new_sched.step()
    for (k, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(UserError, match="groups of other hyperparameters"):
        indexed_optimizer_state({"state": {}, "param_groups": named["param_groups"]}, ["0.weight", "0.bias"],
                                {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.01}]},
                                saved_hyperparameters=True)
