"""HybridDataParallel's pure parts: layers of a model, fusing small neighbours, the policy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hybridpipe.comm.allreduce import Topology, group_costs
from hybridpipe.comm.hybrid_dp import group_small, latency_bound_bytes, model_layers, plan_units


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
    for a, b in zip(groups, groups[1:]):
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
