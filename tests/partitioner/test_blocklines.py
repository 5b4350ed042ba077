"""The batched pricing of many block shapes (``cost/blocklines.py``) against pricing one group at a time.

``block_lines`` prices every shape of a batch in one vectorised pass; each line must be bit for bit
``CostModel.priced_line`` (message by message, the reference) and ``CostModel.fast_lines`` (one group
at a time), whatever else shares the batch; ``BlockSync`` (``StageTerms.block_sync``) must then give
the same sync vectors as pricing each shape alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.blocklines import block_lines
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search import blocksync
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.stageterms import StageTerms
from tests.partitioner.synth import make_profile
from tests.partitioner.test_fastlines import clusters


@st.composite
def batches(draw, cluster: Cluster) -> tuple[int, int, list[tuple[int, int]]]:
    """A copy count, its copy's width wc and 1-6 block shapes (offset, size) of the DP."""
    workers = cluster.total_workers
    copies = draw(st.sampled_from([r for r in range(1, workers + 1) if workers % r == 0]))
    wc = workers // copies
    shapes = draw(st.lists(st.integers(0, wc - 1).flatmap(lambda o: st.tuples(st.just(o), st.integers(1, wc - o))),
                           min_size=1, max_size=6))
    return copies, wc, shapes


def check(cluster: Cluster, copies: int, wc: int, shapes: list[tuple[int, int]], dedicated: bool,
          algorithms: tuple[str, ...] = ALGORITHMS, reference: bool = True) -> None:
    model = CostModel(cluster, aggregator_dedicated=dedicated)
    names, alpha, per_byte = block_lines(model, copies, wc, np.array([o for o, _ in shapes]),
                                         np.array([s for _, s in shapes]), algorithms)
    variants = [(a, h) for a in algorithms for h in ((False, True) if a == "butterfly" else (False,))]
    assert names == [a for a, _ in variants]
    for k, (o, s) in enumerate(shapes):
        ranks = [c * wc + q for c in range(copies) for q in range(o, o + s)]
        got = [(a, float(alpha[k, v]), float(per_byte[k, v])) for v, a in enumerate(names)]
        fast = CostModel(cluster, aggregator_dedicated=dedicated).fast_lines(ranks, algorithms)
        assert got == [(a, ln.alpha_s, ln.s_per_byte) for a, ln in fast], (copies, wc, o, s)
        if reference:
            want = [model.priced_line(a, ranks, halving=h) for a, h in variants]
            assert got == [(a, ln.alpha_s, ln.s_per_byte) for (a, _), ln in zip(variants, want, strict=True)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_workers=120), st.data(), st.booleans())
def test_batched_lines_equal_one_group_at_a_time(cluster, data, dedicated):
    """Any DP block shapes in one batch on 1-4 level clusters (1000 cases up to 600 workers: make test-slow)."""
    copies, wc, shapes = data.draw(batches(cluster))
    algorithms = tuple(data.draw(st.lists(st.sampled_from(ALGORITHMS), min_size=1, unique=True)))
    check(cluster, copies, wc, shapes, dedicated, algorithms)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_workers=600), st.data(), st.booleans())
def test_batched_lines_equal_one_group_at_a_time_many(cluster, data, dedicated):
    copies, wc, shapes = data.draw(batches(cluster))
    check(cluster, copies, wc, shapes, dedicated, reference=cluster.total_workers <= 200)


def test_batched_lines_on_the_benchmark_cluster():
    """Hosts of 8 on a slow network: unequal heads and tails (lock-stepped hierarchical, several group
    sizes in one batch), butterfly folds, every offset, whole copies and one-rank blocks, one batch each."""
    cluster = Cluster((Level("node", 8, 100.0, 5.0), Level("network", 32, 1.0, 50.0)), 32.0)
    for copies in (1, 4, 32):
        wc = 256 // copies
        shapes = sorted({(o % wc, min(s, wc - o % wc)) for o in range(8) for s in (1, 2, 3, 7, 8, 9, 17, 64, 200)})
        check(cluster, copies, wc, shapes, False, reference=False)
        check(cluster, copies, wc, shapes[::7], True)


@pytest.mark.parametrize("batch_ranks", [1 << 20, 50])
def test_stage_terms_price_a_batch_as_each_shape_alone(batch_ranks, monkeypatch):
    """``BlockSync``' sync vectors from one batch (or several, at most ``batch_ranks`` ranks each) equal
    pricing every shape alone (``fast_lines``, the fastest algorithm per node, the refined size
    factor), on a profile with weightless nodes."""
    monkeypatch.setattr(blocksync, "BATCH_RANKS", batch_ranks)
    cluster = Cluster((Level("node", 4, 100.0, 5.0), Level("network", 16, 1.0, 50.0)), 32.0)
    costs = model_costs(make_profile([(1.0 + k, 2.0 + k, 4096 * k, (k % 3) * 40_000_000) for k in range(10)]))
    model = CostModel(cluster)
    for copies in (1, 4):
        t = StageTerms(costs, model, 64, copies, Options(get_schedule("1f1b"), 128))
        shapes = [(o, s) for o in range(4) for s in (1, 2, 5, 9, 16 - o) if o + s <= t.wc]
        t.block_sync.price(shapes)
        for o, s in shapes:
            ranks = np.add.outer(np.arange(copies) * t.wc, np.arange(o, o + s)).ravel()
            lines = model.fast_lines(ranks, t.opts.algorithms)
            best = np.min([ln.alpha_s + ln.s_per_byte * costs.param_bytes for _, ln in lines], axis=0)
            want = np.where(costs.param_bytes > 0, best * model.allreduce_factor(costs.param_bytes) * 1e3, 0.0)
            assert np.array_equal(t.block_sync.sync_ms(o, s), want), (copies, o, s)
        assert t.block_sync.priced == len(shapes)
