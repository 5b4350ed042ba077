"""The hybrid per-layer policy: the lane, the choice (vs brute force), the closed form (vs the lane)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.layersync import choose_layer_algorithms, plan_layer_syncs, simulate_lane
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.search.lanes import lane_row, lane_terms
from tests.partitioner.synth import make_profile, two_level


def test_lane_by_hand():
    # layers 0..2 in forward order; backward runs 2, 1, 0 (each 10 ms): ready at 10, 20, 30
    lane = simulate_lane([5.0, 0.0, 25.0], [10.0, 10.0, 10.0], [4.0, 4.0, 4.0])
    # layer 2 syncs 10..35; layer 0 waits for the lane: 35..40. Next forward starts at 30:
    # layer 0 needed at 30 (late 10), layer 2 needed at 38 -> already 10 late from layer 0, it ends 35: no more
    assert lane.finish_ms == (40.0, 0.0, 35.0)
    assert lane.exposed_ms == (10.0, 0.0, 0.0) and lane.total_exposed_ms == 10.0
    assert simulate_lane([5.0, 0.0, 25.0], [10.0] * 3, [4.0] * 3, gap_ms=6.0).total_exposed_ms == 4.0
    assert simulate_lane([5.0, 0.0, 25.0], [10.0] * 3, [4.0] * 3, gap_ms=60.0).total_exposed_ms == 0.0


def lane_of_choice(choice, nbytes, ranks, model, b, f):
    sync = [model.allreduce_seconds(a, n, ranks) * 1e3 if n else 0.0 for a, n in zip(choice, nbytes, strict=True)]
    return simulate_lane(sync, b, f).total_exposed_ms


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 512, 40_000, 3_000_000, 40_000_000]),
                          st.floats(0.0, 30.0), st.floats(0.0, 30.0)), min_size=1, max_size=4),
       st.integers(2, 8))
def test_fastest_per_layer_minimises_exposure(layers, n):
    model = CostModel(two_level(4, 2))
    ranks = list(range(n))
    nbytes, b, f = (list(x) for x in zip(*layers, strict=True))
    sync = choose_layer_algorithms([f"l{k}" for k in range(len(layers))], nbytes, b, f, ranks, model)
    brute = min(lane_of_choice(c, nbytes, ranks, model, b, f)
                for c in itertools.product(ALGORITHMS, repeat=len(layers)))
    assert sync.exposed_ms == pytest.approx(brute, abs=1e-9)
    assert sum(lv.exposed_ms for lv in sync.layers) == pytest.approx(sync.exposed_ms)
    assert [lv.layer for lv in sync.layers] == [f"l{k}" for k, x in enumerate(nbytes) if x]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.0, 1.0, 7.5, 40.0]), st.floats(0.0, 20.0), st.floats(0.0, 20.0)),
                min_size=1, max_size=9))
def test_closed_form_equals_the_lane_for_every_range(layers):
    sync, b, f = (np.array(x) for x in zip(*layers, strict=True))
    terms = lane_terms(sync, b, f)
    n = len(layers)
    for i in range(n):
        row = lane_row(terms, float(b[:i].sum() + f[:i].sum()), i)
        for j in range(i, n):
            lane = simulate_lane(sync[i:j + 1], b[i:j + 1], f[i:j + 1]).total_exposed_ms
            assert row[j - i] == pytest.approx(lane, abs=1e-9)


def test_hybrid_choice_follows_layer_size():
    """Seed 000's observation: latency-bound algorithms for small layers, bandwidth-bound for large."""
    prof = make_profile([(1, 2, 1000, 4_000), (1, 2, 1000, 80_000_000)])
    model = CostModel(two_level(1, 4))
    sync = plan_layer_syncs(prof.nodes, range(4), model)
    small, large = sync.layers
    assert small.algorithm in ("butterfly", "aggregator", "torus2d") and small.params == ("l1.weight",)
    assert large.algorithm in ("ring", "native", "butterfly", "torus2d", "hierarchical")
    assert model.allreduce_seconds(small.algorithm, 4_000, range(4)) < model.allreduce_seconds("ring", 4_000, range(4))
    assert plan_layer_syncs(prof.nodes, [3], model).layers == ()
