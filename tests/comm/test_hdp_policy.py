"""HybridDataParallel's pure parts: layers of a model, fusing small neighbours, the policy."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hybridpipe.comm.allreduce import Topology, group_costs
from hybridpipe.comm.hybrid_dp import (
    UnitChoice,
    group_small,
    latency_bound_bytes,
    model_layers,
    plan_units,
    units_from_choices,
)
from hybridpipe.comm.hybrid_dp.policy import URGENT_CANDIDATES, urgent_units


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=True)
        self.head.weight = self.emb.weight          # shared with the embedding
        self.scale = nn.Parameter(torch.ones(1))


def test_layers_in_forward_order_own_parameters_once() -> None:
    layers = model_layers(Tied())
    assert [layer.name for layer in layers] == ["", "emb", "head"]          # root's own 'scale' first
    assert [layer.param_names for layer in layers] == [("scale",), ("emb.weight",), ("head.bias",)]
    assert layers[1].nbytes == 10 * 4 * 4


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), max_size=20), small=st.integers(0, 120))
def test_group_small_keeps_order_and_bounds(sizes, small) -> None:
    groups = group_small(sizes, small)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for g in groups:
        assert len(g) == 1 or sum(sizes[i] for i in g) <= small
        assert len(g) == 1 or all(sizes[i] <= small for i in g)
    # greedy: a group could not have taken the next layer
    for a, b in pairwise(groups):
        if len(a) > 0 and all(sizes[i] <= small for i in a) and sizes[b[0]] <= small:
            assert sum(sizes[i] for i in a) + sizes[b[0]] > small


def test_latency_bound_of_a_linear_cost() -> None:
    alpha, beta = 1e-4, 1e-9
    bound = latency_bound_bytes(lambda b: alpha + beta * b)
    assert bound == pytest.approx((alpha + 2 * beta) / beta, rel=0.02)
    assert latency_bound_bytes(lambda b: 0.0) == 0.0


def _mlp_units(policy: str, n: int = 4):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4096), nn.Linear(4096, 4096))
    return plan_units(model_layers(model), policy, group_costs(Topology.from_labels(range(n))))


def test_hybrid_policy_small_layers_fused_and_latency_bound_big_ones_bandwidth_bound() -> None:
    units = _mlp_units("hybrid")
    assert [u.name for u in units] == ["0+1", "2", "3"]      # the two tiny layers share one all-reduce
    assert units[0].algorithm in ("butterfly", "aggregator")
    assert units[-1].algorithm in ("native", "ring", "hierarchical", "torus2d", "butterfly")
    assert units[-1].predicted_ms > units[0].predicted_ms


def test_fixed_policy_uses_its_algorithm_everywhere() -> None:
    assert {u.algorithm for u in _mlp_units("torus2d")} == {"torus2d"}
    with pytest.raises(ValueError, match="unknown sync policy"):
        _mlp_units("fastest")


ALEXNET_UNITS = [139_264, 2_458_624, 3_539_968, 5_309_440, 3_539_968, 151_011_328, 67_125_248, 16_388_000]


def test_urgent_units_alexnet_convolutions_not_equal_layers() -> None:
    assert urgent_units(ALEXNET_UNITS) == [0, 1, 2, 3, 4]          # every conv waits behind fc1..fc3
    assert urgent_units([4 << 20] * 24) == []                       # a stack of equal layers: one lane
    assert urgent_units([]) == [] and urgent_units([0, 0, 5]) == []


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10**9), max_size=12))
def test_urgent_units_rule(sizes) -> None:
    got = set(urgent_units(sizes))
    for i, s in enumerate(sizes):
        want = s > 0 and 8 * s <= sum(sizes[i + 1:]) and 8 * s <= max(sizes)
        assert (i in got) == want


class AlexLike(nn.Module):
    """AlexNet's unit sizes in miniature order: small early layers, then big ones."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.big = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, 16)


@pytest.mark.parametrize("policy", ["hybrid", "ring", "native"])
def test_plan_puts_urgent_units_on_the_second_lane(policy) -> None:
    costs = group_costs(Topology(((0,), (1,), (2,), (3,))))
    units = plan_units(model_layers(AlexLike()), policy, costs, fuse_small=False)
    lanes = {u.name: u.lane for u in units}
    if policy == "native":                       # gloo's collective: one lane only
        assert set(lanes.values()) == {0}
        return
    assert lanes == {"a": 1, "b": 1, "big": 0, "out": 0}
    for u in units:
        if u.lane == 1:
            assert u.algorithm in URGENT_CANDIDATES and (policy == "hybrid" or u.algorithm == policy)
    single = plan_units(model_layers(AlexLike()), policy, costs, fuse_small=False, two_lanes=False)
    assert {u.lane for u in single} == {0}


# ---- explicit choices (a plan's units, run as given) -----------------------------------------

def test_explicit_choices_become_the_units_as_given() -> None:
    layers = model_layers(Tied())
    units = units_from_choices(layers, [UnitChoice(("head.bias", "scale"), "native", 0, "mine"),
                                        UnitChoice(("emb.weight",), "torus2d", 1)])
    assert [(u.name, u.algorithm, u.lane) for u in units] == [("mine", "native", 0), ("emb", "torus2d", 1)]
    assert [u.param_names for u in units] == [("scale", "head.bias"), ("emb.weight",)]   # module order inside
    assert {id(p) for u in units for p in u.params} == {id(p) for layer in layers for p in layer.params}


@pytest.mark.parametrize("choices,expected", [
    ([UnitChoice(("scale", "emb.weight", "head.bias"), "telepathy")], "unknown all-reduce algorithm 'telepathy'"),
    ([UnitChoice(("scale", "emb.weight", "head.bias"), "native", 1)], "lane 1 cannot run native"),
    ([UnitChoice(("scale", "emb.weight"), "ring")], "parameter 'head.bias' is in no sync unit"),
    ([UnitChoice(("scale", "emb.weight", "head.bias"), "ring"), UnitChoice(("scale",), "ring")],
     "parameter 'scale' is in sync units 0 and 1"),
    ([UnitChoice(("scale", "emb.weight", "head.bias", "frozen.weight"), "ring")], "'frozen.weight', which the module"),
])
def test_explicit_choices_that_cannot_run_fail_in_one_line(choices, expected) -> None:
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        units_from_choices(model_layers(Tied()), choices)
