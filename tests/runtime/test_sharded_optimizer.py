"""ShardedOptimizer without processes: an optimizer whose state cannot be split is one line
(UserError: exit 2 at the CLI); unbound, it is the optimizer it wraps, parameter groups included."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer


class Custom(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize("make", [lambda ps: torch.optim.RMSprop(ps), lambda ps: Custom(ps)])
def test_an_optimizer_whose_state_cannot_be_split_is_one_line(make):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UserError) as e:
        ShardedOptimizer(model.parameters(), make)
    assert "\n" not in str(e.value) and "cannot be split" in str(e.value)


def test_unbound_it_steps_like_the_optimizer_it_wraps():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(a.parameters(), lr=0.01)
    wrapped = ShardedOptimizer(b.parameters(), lambda ps: torch.optim.AdamW(ps, lr=0.01))
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, opt in ((a, plain), (b, wrapped)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert wrapped.state_dict()["state"].keys() == plain.state_dict()["state"].keys()


def test_parameter_groups_are_kept_unbound_as_torch_keeps_them():
    """Two groups (decayed matrices, undecayed vectors) at their own learning rates, moved by a
    scheduler as the outer groups: the same steps and torch's own state_dict layout."""
    def grouped(ps):
        return torch.optim.AdamW([{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
                                  {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0, "lr": 0.02}], lr=0.01)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain, wrapped = grouped(list(a.parameters())), ShardedOptimizer(b.parameters(), grouped)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (plain, wrapped)]
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, opt, sched in ((a, plain, scheds[0]), (b, wrapped, scheds[1])):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
            sched.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    ours, theirs = wrapped.state_dict(), plain.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]


class _Switch(torch.nn.Module):
    """One sync unit of three layers: ``a`` always runs, ``b`` only where a sample asks for it, ``c``
    never (an expert no token chose)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


@pytest.mark.parametrize("level", ["optimizer", "gradients", "parameters"])
def test_a_parameter_no_replica_had_a_gradient_for_is_skipped_and_saved_as_torch_does(level):
    """Two replicas (threads) sharding three layers (a sync unit each; an eager module: any of them may
    get no gradient), AdamW with weight decay: ``b`` gets a gradient on one replica in the first step,
    on none in the second; ``c`` on none ever. As torch's AdamW on the unsplit module over both
    replicas' samples: ``b`` and ``c`` untouched where no replica had a gradient (no decay), ``b``'s
    step count 1, ``c`` without state; the gathered state_dict has torch's entries and step counts.
    Before: ``b``'s unit was reduce-scattered by the replica that used it only (the other never
    answered: a timeout); with ``a``, ``b``, ``c`` in one unit, its zeros stepped them (``c`` decayed
    and saved with step 2, ``b`` saved with step 2)."""
    from hybridpipe.comm.hybrid_dp import UnitChoice
    from hybridpipe.comm.sharded import ShardedReplicas, whole_weights
    from hybridpipe.pipeline.inprocess import InProcessGroup, run_ranks

    def make(ps):
        return torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5)

    torch.manual_seed(0)
    plain = _Switch()
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    uses = [[True, False], [False, False]]            # step -> replica -> does its sample run b
    opt = make(list(plain.parameters()))
    for step in range(2):
        opt.zero_grad()
        sum(plain(xs[r], uses[step][r]).square().sum() for r in range(2)).backward()
        opt.step()
    names = {id(p): n for n, p in plain.named_parameters()}
    want = {names[id(p)]: st for p, st in opt.state.items()}
    group = InProcessGroup(2, timeout=10)

    def rank(r: int):
        module = _Switch()
        module.load_state_dict(start)
        units = [UnitChoice((f"{m}.weight", f"{m}.bias"), "ring", 0, m) for m in "abc"]
        shard = ShardedReplicas(module, group.transport(r), units, level)
        sharded = ShardedOptimizer(module.parameters(), make)
        sharded.bind([shard])

        def run():
            for step in range(2):
                sharded.zero_grad()
                with whole_weights([shard]):
                    module(xs[r], uses[step][r]).square().sum().backward()
                shard.finish()
                sharded.step()
            saved = sharded.state_dict()
            with whole_weights([shard]):
                weights = {k: v.clone() for k, v in module.state_dict().items()}
            shard.close()
            return weights, saved
        return run

    for weights, saved in run_ranks({r: rank(r) for r in range(2)}).values():
        assert max(float((weights[k] - v).abs().max()) for k, v in plain.state_dict().items()) <= 1e-6
        assert torch.equal(weights["c.weight"], start["c.weight"])
        order = [n for n, _ in plain.named_parameters()]
        got = {order[i]: st for i, st in saved["state"].items()}
        assert set(got) == set(want) == {"a.weight", "a.bias", "b.weight", "b.bias"}
        for n, st in want.items():
            assert float(got[n]["step"]) == float(st["step"]), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert float((got[n][key] - st[key]).abs().max()) <= 1e-6, (n, key)


def test_only_modules_a_graph_calls_as_they_are_may_leave_a_parameter_without_gradient():
    """run_as_written: what the replicas sync once a step and agree on: the parameters of a graph's
    leaf modules (eager code inside), none of a graph's own operations (nor of torch's modules it calls)."""
    from torch import fx

    from hybridpipe.pipeline.opaque import run_as_written

    class OneLeaf(fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, name: str) -> bool:
            return name == "1"

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _Switch(), torch.nn.Linear(3, 3))
    model[1].forward = lambda x: model[1].a(x)          # a one-argument forward to trace
    graph = fx.GraphModule(model, OneLeaf().trace(model))
    assert [id(p) for p in run_as_written(graph)] == [id(p) for p in graph.get_submodule("1").parameters()]
    assert run_as_written(model) == []                        # not a graph: nothing known
    traced = fx.GraphModule(model, type("All", (fx.Tracer,), {"is_leaf_module": lambda *_: False})().trace(model))
    assert run_as_written(traced) == []
