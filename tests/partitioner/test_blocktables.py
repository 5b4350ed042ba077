"""The period tables of ``search/blocktables.py`` against the direct forms they replace (and the cluster's own
``level_between`` for the levels), on random clusters, copy counts and blocks."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.search.blocktables import BlockTables, busiest_share_of, grouped, level_of


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).filter(lambda f: 2 <= math.prod(f) <= 216), st.data())
def test_tables_equal_the_direct_forms(fanouts, data):
    cluster = Cluster(tuple(Level(f"l{k}", w, 1.0) for k, w in enumerate(fanouts)), 16.0)
    workers = cluster.total_workers
    copies = data.draw(st.sampled_from([r for r in range(1, workers + 1) if workers % r == 0]))
    wc = workers // copies
    levels = len(fanouts)
    spans = np.array([cluster.span(k) for k in range(levels)], dtype=np.int64)
    period = cluster.span(levels - 2) if levels > 1 else 1
    tables = BlockTables(spans, period, copies, wc)
    x = np.array(data.draw(st.lists(st.integers(0, wc - 1), min_size=1, max_size=20)))
    y = np.array([data.draw(st.integers(int(a) + 1, wc)) for a in x])
    far = (copies - 1) * wc + y - 1
    assert tables.level_between(x, far).tolist() == level_of(spans, x, far).tolist() == \
        [cluster.level_between(int(a), int(b)) for a, b in zip(x, far, strict=True)]
    level = np.array([data.draw(st.integers(0, levels - 1)) for _ in x])
    assert tables.busiest_share(x, y, level).tolist() == busiest_share_of(spans, copies, x, y, level).tolist()


def test_grouped_lists_each_key_once_with_all_its_indices():
    keys = np.array([5, 2, 5, 9, 2, 2])
    assert [(k, i.tolist()) for k, i in grouped(keys)] == [(2, [1, 4, 5]), (5, [0, 2]), (9, [3])]
    assert grouped(np.array([], dtype=np.int64)) == []
