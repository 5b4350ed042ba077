"""The all-reduce schedules as data: every rank ends with the sum (in-memory simulation), the
structural rules the executors rely on hold, and what the executor sends is what the partitioner's
cost model prices (one description, ``partitioner/cost/collectives.py``, for both)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.comm.allreduce import schedule
from hybridpipe.comm.allreduce.executor import _expand
from hybridpipe.comm.allreduce.flat import FlatSpace
from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.priced import PricedRound
from tests.partitioner.synth import flat_cluster, two_level


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


# ---- the rounds that run are the rounds that are priced ----------------------------------------

NUMEL = 2520 * 8      # divisible by every split of up to 9 ranks, so element counts are exact


def _variants(n: int) -> list[tuple[str, dict, Cluster]]:
    """(algorithm, cost-model keywords, cluster) for every algorithm and variant on n ranks."""
    flat = flat_cluster(n)
    out = [("ring", {}, flat), ("butterfly", {"halving": False}, flat), ("butterfly", {"halving": True}, flat),
           ("aggregator", {}, flat)]
    out += [("torus2d", {"shape": shape}, flat) for shape in co.torus_shapes(n)]
    out += [("hierarchical", {}, two_level(size, -(-n // size))) for size in range(1, n + 1)]
    return out


def _executed_elements(rounds: list[schedule.Round], n: int, algorithm: str) -> tuple[list[int], list[int]]:
    """Elements each position sends and receives: the ops the pipelined executor issues (its own expansion)."""
    space = FlatSpace([torch.zeros(NUMEL // 3), torch.zeros(NUMEL - NUMEL // 3)], NUMEL // 7)
    sent, received = [0] * n, [0] * n
    for me in range(n):
        sends, recvs = _expand(rounds, me, space, 0, algorithm)
        sent[me] = sum(op.hi - op.lo for queue in sends.values() for op in queue)
        received[me] = sum(op.hi - op.lo for op in recvs)
    return sent, received


def _priced_elements(priced: list[PricedRound], n: int) -> tuple[list[float], list[float]]:
    """Elements each rank sends and receives in the rounds the cost model prices."""
    sent, received = [0.0] * n, [0.0] * n
    for r in priced:
        for src, dst, part in r.messages:
            sent[src] += r.repeat * part * NUMEL
            received[dst] += r.repeat * part * NUMEL
    return sent, received


@pytest.mark.parametrize("n", range(2, 10))
def test_the_executor_sends_what_the_cost_model_prices(n: int) -> None:
    """Every algorithm and variant on 2..9 ranks: per rank, the elements the executor's ops move
    equal those of the rounds the cost model prices (both come from collectives.py)."""
    ranks = list(range(n))
    for algorithm, variant, cluster in _variants(n):
        model = CostModel(cluster)
        if algorithm == "hierarchical":         # the executor's hosts are the model's groups
            assert model.groups(ranks) == [list(u) for u in Topology.blocks(n, cluster.levels[0].workers).units]
        rounds = schedule.elements(model.collective(algorithm, ranks, **variant), NUMEL)
        schedule.check(rounds, n, NUMEL)
        executed = _executed_elements(rounds, n, algorithm)
        priced = _priced_elements(model.rounds(algorithm, ranks, **variant), n)
        assert executed == tuple([pytest.approx(x, abs=1e-6) for x in side] for side in priced), \
            (algorithm, variant)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 8])
def test_the_prediction_is_priced_from_those_rounds(n: int) -> None:
    """On one flat level every rank has its own link: a round costs its latencies, its busiest
    rank's bytes in or out, and its largest sum; the model's line is that, summed over the rounds."""
    ranks = list(range(n))
    for algorithm, variant, cluster in _variants(n):
        if algorithm == "hierarchical":
            continue
        model = CostModel(cluster)
        fit = model.link(0, algorithm)
        alpha = per_byte = 0.0
        for r in model.rounds(algorithm, ranks, **variant):
            out, inn = [0.0] * n, [0.0] * n
            for src, dst, part in r.messages:
                out[src] += part
                inn[dst] += part
            alpha += r.repeat * r.steps * fit.alpha_s
            per_byte += r.repeat * (max(out + inn) * fit.beta_s_per_byte + r.reduce * model.gamma)
        line = model.line(algorithm, ranks, **variant)
        assert (line.alpha_s, line.s_per_byte) == (pytest.approx(alpha), pytest.approx(per_byte)), (algorithm, variant)


def test_native_is_priced_as_gloos_ring_and_has_no_schedule_of_ours() -> None:
    model = CostModel(flat_cluster(4))
    assert model.collective("native", range(4)) == model.collective("ring", range(4))
    assert model.line("native", range(4)) == model.line("ring", range(4))


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
