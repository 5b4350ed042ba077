"""Baseline strategies and PipeDream's original recurrence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.pipedream import pipedream_stages
from hybridpipe.partitioner.search.strategies import baseline_stages, uniform_sizes
from tests.partitioner.synth import flat_cluster, make_profile, two_level

LAYERS = [(2.0, 4.0, 1_000_000, 100_000), (3.0, 6.0, 500_000, 2_000_000), (1.0, 2.0, 100_000, 50_000_000),
          (0.5, 1.0, 10_000, 8_000_000)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 8))
def test_balanced_sizes_minimise_the_largest_group(weights, parts):
    parts = min(parts, len(weights))
    sizes = balanced_sizes(np.array(weights, dtype=float), [1.0] * parts)
    assert len(sizes) == parts and sum(sizes) == len(weights) and min(sizes) >= 1

    def worst(cuts):
        bounds = (0, *cuts, len(weights))
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

    best = min(worst(c) for c in itertools.combinations(range(1, len(weights)), parts - 1))
    assert worst(tuple(np.cumsum(sizes)[:-1])) == best


def test_uniform_sizes():
    assert uniform_sizes(7, 3) == [3, 2, 2] and uniform_sizes(4, 4) == [1, 1, 1, 1]


def test_baselines_shapes():
    costs = model_costs(make_profile(LAYERS))                  # 6 nodes
    dp = baseline_stages("dp", costs, 4)
    assert len(dp) == 1 and dp[0].ranks == (0, 1, 2, 3)
    time = baseline_stages("time", costs, 4)
    assert [len(s.ranks) for s in time] == [1, 1, 1, 1] and time[-1].last == 5
    uniform = baseline_stages("uniform", costs, 4, stages=2)
    assert [(s.first, s.last, s.ranks) for s in uniform] == [(0, 2, (0, 1)), (3, 5, (2, 3))]
    params = baseline_stages("params", costs, 2)
    assert [s.last for s in params] == [2, 5] or [s.last for s in params] == [3, 5]
    assert any(s.first <= 3 <= s.last and s.last - s.first <= 1 for s in baseline_stages("params", costs, 4))


@pytest.mark.parametrize("strategy,workers,stages,message", [
    ("time", 4, 2, "replicates nothing"),
    ("uniform", 4, 3, "must divide the 4 workers"),
    ("params", 8, None, "needs 8 stages but the profile has only 6 nodes"),
    ("dp", 4, 2, "makes one stage"),
])
def test_baseline_errors(strategy, workers, stages, message):
    with pytest.raises(UserError, match=message):
        baseline_stages(strategy, model_costs(make_profile(LAYERS)), workers, stages)


def test_pipedream_formula_by_hand():
    """Two layers on two workers of one level: PipeDream compares replicating everything
    ((C + 4 (m-1) P / (B m)) / m) with one stage per worker (max of the two computes)."""
    layers = [(10.0, 20.0, 1_000, 1_000), (10.0, 20.0, 1_000, 500_000_000)]
    costs = model_costs(make_profile(layers, input_bytes=0))
    # 1 Gbit/s = 125,000 bytes per ms: replicating the 500 MB layer costs 4 * 1 * 5e8 / (1.25e5 * 2) / 2 = 4000 ms
    split = pipedream_stages(costs, flat_cluster(2, gbps=1.0))
    assert [len(s.ranks) for s in split] == [1, 1]
    # with cheap weights replication wins: (45 + 4 * 3000 / (1.25e5 * 2)) / 2 = 22.5 < max(30, 15)
    cheap = model_costs(make_profile([(10.0, 20.0, 1_000, 1_000), (5.0, 10.0, 1_000, 2_000)], input_bytes=0))
    assert [len(s.ranks) for s in pipedream_stages(cheap, flat_cluster(2, gbps=1.0))] == [2]


def test_pipedream_nests_levels_replica_major():
    costs = model_costs(make_profile(LAYERS))
    stages = pipedream_stages(costs, two_level(2, 2, outer_gbps=0.01))
    assert sorted(r for s in stages for r in s.ranks) == [0, 1, 2, 3]
    assert stages[0].first == 0 and stages[-1].last == 5
    # light weights: one outer stage on both hosts running the inner plan (replicate) in each,
    # ranks ordered replica-major so that micro-batch m stays on host m % 2
    light = model_costs(make_profile([(layer[0], layer[1], layer[2], 1_000) for layer in LAYERS]))
    assert [s.ranks for s in pipedream_stages(light, two_level(2, 2, outer_gbps=10.0))] == [(0, 2, 1, 3)]
    # its memory check: stashes ceil((M - m) / m) minibatches, none when everything is replicated
    assert [len(s.ranks) for s in pipedream_stages(costs, flat_cluster(4), memory_bytes=1.0)] == [4]
    assert pipedream_stages(costs, flat_cluster(4, gbps=0.001), memory_bytes=1.0) is not None
