"""The closed-form link loads (``cost/fastlines.py``) against the message-by-message pricing they replace.

``CostModel.priced_line`` builds every message of every round (``collectives.py``), sums each link's
bytes (``CostModel._loads``) and prices the busiest link per level: the reference. ``fast_lines``
must give the very same lines, bit for bit, for every algorithm and variant, on any group of ranks
and on the DP's block shapes (R copies of one block of ranks, ``StageTerms.sync_ms``).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import ALGORITHMS

VARIANTS = [(a, h) for a in ALGORITHMS for h in ((False, True) if a == "butterfly" else (False,))]


@st.composite
def clusters(draw, max_workers: int) -> Cluster:
    """1 to 4 levels, 2 to ``max_workers`` workers in all, any fan-outs, bandwidths and latencies."""
    fanouts = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4).filter(
        lambda f: 2 <= math.prod(f) <= max_workers))
    levels = tuple(Level(f"l{k}", w, draw(st.sampled_from([0.5, 1.0, 10.0, 100.0])),
                         draw(st.sampled_from([0.0, 5.0, 50.0]))) for k, w in enumerate(fanouts))
    return Cluster(levels, 16.0)


@st.composite
def blocks(draw, cluster: Cluster) -> list[int]:
    """R copies of the block [o, o + s) of a copy's wc = W / R ranks (the DP's block shapes)."""
    workers = cluster.total_workers
    copies = draw(st.sampled_from([r for r in range(1, workers + 1) if workers % r == 0]))
    wc = workers // copies
    o = draw(st.integers(0, wc - 1))
    s = draw(st.integers(1, wc - o))
    return [c * wc + q for c in range(copies) for q in range(o, o + s)]


def check(cluster: Cluster, ranks: list[int], dedicated: bool) -> None:
    model = CostModel(cluster, aggregator_dedicated=dedicated)
    want = [(a, model.priced_line(a, ranks, halving=h)) for a, h in VARIANTS]
    assert CostModel(cluster, aggregator_dedicated=dedicated).fast_lines(ranks) == want


def group(cluster: Cluster, data) -> list[int]:
    """A block shape or any set of ranks."""
    if data.draw(st.booleans()):
        return data.draw(blocks(cluster))
    workers = cluster.total_workers
    return sorted(data.draw(st.sets(st.integers(0, workers - 1), min_size=1, max_size=workers)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_workers=160), st.data(), st.booleans())
def test_fast_lines_equal_the_message_pricing(cluster, data, dedicated):
    """Blocks and any groups on 1-4 level clusters of up to 160 workers (3000 cases: make test-slow)."""
    check(cluster, group(cluster, data), dedicated)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_workers=600), st.data(), st.booleans())
def test_fast_lines_equal_the_message_pricing_many(cluster, data, dedicated):
    check(cluster, group(cluster, data), dedicated)


def test_fast_lines_equal_the_message_pricing_on_the_benchmark_cluster():
    """Hosts of 8 on a slow network (``benchmarks/partitioner_speed.py``): unequal head and tail
    blocks (lock-stepped hierarchical, the squarest torus), butterfly folds, several copies."""
    cluster = Cluster((Level("node", 8, 100.0, 5.0), Level("network", 32, 1.0, 50.0)), 32.0)
    for copies, o, s in ((1, 3, 200), (2, 5, 100), (4, 0, 64), (8, 7, 17), (16, 1, 6), (1, 0, 256), (32, 2, 3)):
        wc = 256 // copies
        check(cluster, [c * wc + q for c in range(copies) for q in range(o, o + s)], False)
