"""The all-reduce schedules as data: every rank ends with the sum (in-memory simulation), the
structural rules the executors rely on hold, and the rounds are the partitioner's cost-model
rounds message for message (so its predictions describe what runs)."""

from __future__ import annotations

from fractions import Fraction
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.comm.allreduce import schedule
from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.partitioner import collectives as co


def _all_schedules(n: int, numel: int, topology: Topology) -> dict[str, list[schedule.Round]]:
    out = {"ring": schedule.ring(n, numel),
           "butterfly-doubling": schedule.butterfly(n, numel, False),
           "butterfly-halving": schedule.butterfly(n, numel, True),
           "hierarchical": schedule.hierarchical(topology.units, numel),
           "aggregator": schedule.aggregator(n, numel)}
    for rows, cols in co.torus_shapes(n):
        out[f"torus2d-{rows}x{cols}"] = schedule.torus2d(n, numel, rows, cols)
    return out


@st.composite
def _topologies(draw, n: int) -> Topology:
    labels = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return Topology.from_labels(labels)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), numel=st.integers(0, 40))
def test_every_schedule_sums_on_every_rank(data, n: int, numel: int) -> None:
    topology = data.draw(_topologies(n))
    vectors = [[(r + 1) * 1000 + x for x in range(numel)] for r in range(n)]
    want = [sum(v[x] for v in vectors) for x in range(numel)]
    for name, rounds in _all_schedules(n, numel, topology).items():
        schedule.check(rounds, n, numel)
        got = schedule.simulate(rounds, vectors)
        assert all(g == want for g in got), f"{name}, n={n}, numel={numel}, units={topology.units}"


def test_simulation_catches_a_broken_schedule() -> None:
    rounds = schedule.ring(4, 12)
    broken = rounds[:-1]                               # drop the last all-gather round
    out = schedule.simulate(broken, [[1] * 12] * 4)
    assert any(v != [4] * 12 for v in out)


@pytest.mark.parametrize("bad, why", [
    ([schedule.Round("fold", (schedule.Msg(0, 0, 0, 4, True),))], "endpoint"),
    ([schedule.Round("fold", (schedule.Msg(0, 1, 3, 3, True),))], "empty"),
    ([schedule.Round("fold", (schedule.Msg(0, 1, 0, 2, True), schedule.Msg(0, 1, 2, 4, True)))], "two messages"),
    ([schedule.Round("fold", (schedule.Msg(0, 2, 0, 3, False), schedule.Msg(1, 2, 2, 4, True)))], "overlapping"),
])
def test_check_rejects_what_the_executors_cannot_run(bad, why) -> None:
    with pytest.raises(ValueError, match=why):
        schedule.check(bad, 3, 4)


def test_split_is_balanced_and_covers() -> None:
    for length in range(0, 30):
        for parts in range(1, 9):
            segs = schedule.split(5, 5 + length, parts)
            assert segs[0][0] == 5 and segs[-1][1] == 5 + length
            assert all(a[1] == b[0] for a, b in pairwise(segs))
            sizes = [b - a for a, b in segs]
            assert max(sizes) - min(sizes) <= 1


# ---- the same rounds as the partitioner's cost model -----------------------------------------

NUMEL = 2520 * 8      # divisible by every split of up to 9 ranks, so fractions are exact


def _ours(rounds: list[schedule.Round]) -> list[frozenset]:
    return [frozenset((m.src, m.dst, Fraction(m.hi - m.lo, NUMEL)) for m in r.msgs) for r in rounds]


def _theirs(rounds: list[co.Round]) -> list[frozenset]:
    out = []
    for r in rounds:
        msgs = frozenset((s, d, Fraction(f).limit_denominator(10000)) for s, d, f in r.messages)
        out += [msgs] * r.repeat
    return out


@pytest.mark.parametrize("n", range(2, 10))
def test_rounds_match_the_cost_model(n: int) -> None:
    ranks = list(range(n))
    assert _ours(schedule.ring(n, NUMEL)) == _theirs(co.ring_rounds(ranks))
    for halving in (False, True):
        assert _ours(schedule.butterfly(n, NUMEL, halving)) == _theirs(co.butterfly_rounds(ranks, halving))
    for rows, cols in co.torus_shapes(n):
        assert _ours(schedule.torus2d(n, NUMEL, rows, cols)) == _theirs(co.torus_rounds(ranks, rows, cols))
    for size in range(1, n + 1):
        units = Topology.blocks(n, size).units
        assert _ours(schedule.hierarchical(units, NUMEL)) == _theirs(co.hierarchical_rounds(units)), units
    # the aggregator's two rounds are one cut-through round in the model
    ours = schedule.aggregator(n, NUMEL)
    theirs = co.aggregator_rounds(ranks, dedicated=False)
    assert len(theirs) == 1 and frozenset().union(*_ours(ours)) == _theirs(theirs)[0]


def _bytes_per_rank(rounds: list[schedule.Round], n: int) -> tuple[list[int], list[int]]:
    sent, received = [0] * n, [0] * n
    for rnd in rounds:
        for m in rnd.msgs:
            sent[m.src] += m.hi - m.lo
            received[m.dst] += m.hi - m.lo
    return sent, received


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_rabenseifner_moves_exactly_what_ring_moves(n: int) -> None:
    """Power-of-two groups: every rank sends and receives 2(n-1)/n of the vector in both, so
    butterfly's large-message bandwidth equals ring's (the cost model prices them alike)."""
    numel = 64 * n
    ring = _bytes_per_rank(schedule.ring(n, numel), n)
    halving = _bytes_per_rank(schedule.butterfly(n, numel, True), n)
    assert ring == halving == ([2 * (n - 1) * numel // n] * n,) * 2
    assert len(schedule.butterfly(n, numel, True)) == 2 * (n.bit_length() - 1) < len(schedule.ring(n, numel)) or n == 2


def test_butterfly_pairs_exchange_both_ways_ring_does_not() -> None:
    """Why butterfly needs a connection per direction on gloo (transport.py): in each of its
    rounds both ends of a pair send to each other; in a ring's, no pair does."""
    def both_ways(rounds):
        return all({(m.dst, m.src) for m in r.msgs} & {(m.src, m.dst) for m in r.msgs} for r in rounds)
    assert both_ways(schedule.butterfly(8, 64, True))
    assert not any({(m.dst, m.src) for m in r.msgs} & {(m.src, m.dst) for m in r.msgs}
                   for r in schedule.ring(8, 64))
