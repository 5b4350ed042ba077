"""Edge lists are normalised the same way on every rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridpipe.comm.p2p.groups import normalize_edges


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)).filter(lambda e: e[0] != e[1])))
def test_normalised_edges_are_sorted_undirected_and_independent_of_listing_order(edges):
    norm = normalize_edges(edges, 8)
    assert list(norm) == sorted(set(norm))
    assert all(a < b for a, b in norm)
    assert set(norm) == {(min(e), max(e)) for e in edges}
    assert normalize_edges([(b, a) for a, b in reversed(edges)], 8) == norm


@pytest.mark.parametrize("edges, match", [([(1, 1)], "itself"), ([(0, 4)], "outside"), ([(0,)], "pair")])
def test_bad_edges(edges, match):
    with pytest.raises(ValueError, match=match):
        normalize_edges(edges, 4)
