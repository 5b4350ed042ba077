"""Frozen parameters in the plan: held (weights, and as an upper bound their gradients and optimizer
state) but never synced, stepped or accumulated into (the profile's ``trained_bytes``)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.strategies import baseline_stages
from tests.partitioner.synth import flat_cluster, make_profile
from tests.partitioner.test_shard_search import CLUSTERS, LAYER, OPTIONS, check_costs_against_brute_force

LAYERS = [(2.0, 4.0, 300_000, 40_000_000)] * 4


def frozen(profile, share: float):
    """``profile`` with ``share`` of every node's parameter bytes frozen (trained_bytes the rest)."""
    nodes = tuple(dataclasses.replace(n, trained_bytes=int(n.param_bytes * (1 - share))) for n in profile.nodes)
    return dataclasses.replace(profile, nodes=nodes)


def test_a_frozen_share_is_synced_as_a_smaller_model_and_held_as_the_whole():
    """3/4 frozen: the data-parallel stage syncs and steps what a model of 1/4 the parameters would, and holds
    the memory of the whole (weights, gradients and optimizer state, an upper bound)."""
    whole = make_profile(LAYERS)
    quarter = make_profile([(f, b, a, p // 4) for f, b, a, p in LAYERS])
    model, opts = CostModel(flat_cluster(4, 1.0, 50.0)), Options(get_schedule("1f1b"), 8, "adamw")
    stages = baseline_stages("dp", model_costs(whole), 4)
    part, small, big = (evaluate(model_costs(p), model, stages, opts).stages[0]
                        for p in (frozen(whole, 0.75), quarter, whole))
    assert part.sync == small.sync and part.overhead_ms == small.overhead_ms
    assert part.memory_bytes == big.memory_bytes
    assert small.sync.exposed_ms < big.sync.exposed_ms          # the case tells them apart
    costs = model_costs(frozen(whole, 0.75))
    assert costs.param_bytes.sum() == model_costs(quarter).param_bytes.sum()
    assert costs.held.sum() == model_costs(whole).param_bytes.sum()
    assert model_costs(whole).held_bytes is None                 # nothing frozen: one array, as before


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=4), CLUSTERS, OPTIONS, st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_dp_with_frozen_bytes_equals_brute_force(layers, cluster, opts, share):
    """The DP's vectorised terms read the held and the trained bytes as the objective does: its optimum and
    tie-broken plan = enumerating every layout and shard level (20 cases)."""
    costs = model_costs(frozen(make_profile(layers, []), share))
    assert np.all(costs.held >= costs.param_bytes)
    check_costs_against_brute_force(costs, cluster, opts)
