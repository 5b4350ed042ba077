"""The lower bounds the scalable DP prunes with (``lanes.sync_floor``), and the plan evaluation's
vectorised transfer level, against the cost model's own pricing and the straightforward formula."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.lanes import sync_floor
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.stageterms import StageTerms
from hybridpipe.partitioner.search.transfers import transfer_level
from tests.partitioner.synth import make_profile
from tests.partitioner.test_dp_scale import LAYER, clusters


def block(data, cluster):
    """A copy count R (dividing the top level's fan-out), and a block x..x+b-1 of one copy's ranks."""
    top = cluster.levels[-1].workers if len(cluster.levels) > 1 else 1
    copies = data.draw(st.sampled_from([r for r in range(1, top + 1) if top % r == 0]))
    wc = cluster.total_workers // copies
    x = data.draw(st.integers(0, wc - 1))
    return copies, wc, x, data.draw(st.integers(1, wc - x))


@settings(max_examples=150, deadline=None)
@given(clusters(max_workers=48), st.data())
def test_sync_floor_is_below_every_allowed_algorithm(cluster, data):
    """On random groups (blocks of copies on 1-3 level clusters, any algorithm subset, a dedicated
    aggregator or not) every allowed line, and so the fastest, is at least the floor for every node."""
    dedicated = data.draw(st.booleans())
    algorithms = data.draw(st.lists(st.sampled_from(ALGORITHMS), min_size=1, max_size=6, unique=True))
    model = CostModel(cluster, aggregator_dedicated=dedicated)
    copies, wc, x, b = block(data, cluster)
    ranks = [c * wc + q for c in range(copies) for q in range(x, x + b)]
    if len(ranks) < 2:
        return
    top = model.level_between(ranks[0], ranks[-1])
    below = cluster.span(top - 1) if top > 0 else 1
    units = len({r // below for r in ranks})
    nbytes = np.array(data.draw(st.lists(st.sampled_from([0, 1, 8_000, 900_000, 60_000_000]), min_size=1)), float)
    floor = sync_floor(model, top, units, algorithms, nbytes)
    for _, line in model.fast_lines(ranks, algorithms):
        assert (floor <= (line.alpha_s + line.s_per_byte * nbytes) * 1e3).all()
    costs = model_costs(make_profile([(1.0, 2.0, 1000, int(v)) for v in nbytes]))
    t = StageTerms(costs, model, cluster.total_workers, copies,
                   Options(get_schedule("1f1b"), 2 * cluster.total_workers, algorithms=tuple(algorithms)))
    sync = t.block_sync.sync_ms(x % t.period, b)
    assert (sync_floor(model, top, units, algorithms, costs.param_bytes) <= sync).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(LAYER, min_size=1, max_size=8), clusters(max_workers=32), st.data())
def test_exposure_floor_is_below_the_exposure(layers, cluster, data):
    """The exposed sync the search bounds candidates with is at most the exact one, for every stage i..j."""
    costs = model_costs(make_profile(layers))
    model = CostModel(cluster)
    copies, wc, x, b = block(data, cluster)
    opts = Options(get_schedule("1f1b"), 2 * cluster.total_workers)
    t = StageTerms(costs, model, cluster.total_workers, copies, opts)
    top = int(t.level_between(np.array([x]), np.array([(copies - 1) * wc + x + b - 1]))[0])
    for i in range(costs.n):
        js = np.arange(i, costs.n)
        n = len(js)
        floor = t.block_sync.exposure_floor(i, js, np.full(n, x), np.full(n, x + b), np.full(n, top))
        exact = t.block_sync.exposure_row(x % t.period, b, i) if copies * b > 1 else np.zeros(n)
        assert (floor <= exact).all(), (i, floor, exact)


def test_sync_floor_is_zero_below_two_units_and_without_weights():
    from benchmarks.partitioner_speed import cluster as bench_cluster
    model = CostModel(bench_cluster(8, 4))
    assert not sync_floor(model, 1, 1, ALGORITHMS, np.array([1e6])).any()
    assert sync_floor(model, 1, 2, ALGORITHMS, np.array([0.0, 1e6])).tolist()[0] == 0.0
    assert sync_floor(model, 1, 2, ALGORITHMS, np.array([1e6]))[0] > 0


@settings(max_examples=100, deadline=None)
@given(clusters(max_workers=64), st.data())
def test_transfer_level_equals_the_pairwise_formula(cluster, data):
    model = CostModel(cluster)
    ranks = data.draw(st.lists(st.integers(0, cluster.total_workers - 1), min_size=1, max_size=12))
    peers = data.draw(st.lists(st.integers(0, cluster.total_workers - 1), min_size=1, max_size=12))
    want = max(min(model.level_between(p, q) for q in peers) for p in ranks)
    assert transfer_level(model, ranks, peers) == want

