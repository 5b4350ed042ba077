"""The alpha-beta-gamma cost model against hand-computed values, including shared NIC links."""

from __future__ import annotations

import math

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import NOMINAL_SOFTWARE_ALPHA_S, CostModel
from tests.partitioner.synth import flat_cluster

S = 1 << 20
GAMMA = 1 / 4e9


def alpha_beta(gbps: float, latency_us: float = 0.0) -> tuple[float, float]:
    return latency_us * 1e-6 + NOMINAL_SOFTWARE_ALPHA_S, 8 / (gbps * 1e9)


def hier(per_host: int = 4, hosts: int = 2) -> Cluster:
    return Cluster((Level("node", per_host, 40.0, 5.0), Level("network", hosts, 1.0, 50.0)), 4.0)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_is_the_textbook_formula(n):
    m = CostModel(flat_cluster(n))
    a, b = alpha_beta(1.0)
    expected = 2 * (n - 1) * a + 2 * (n - 1) / n * S * b + (n - 1) / n * S * GAMMA
    assert m.allreduce_seconds("ring", S, range(n)) == pytest.approx(expected)
    assert m.allreduce_seconds("native", S, range(n)) == pytest.approx(expected)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_butterfly_variants_on_powers_of_two(n):
    m = CostModel(flat_cluster(n))
    a, b = alpha_beta(1.0)
    k = int(math.log2(n))
    doubling = m.line("butterfly", range(n))
    halving = m.line("butterfly", range(n), halving=True)
    assert doubling.alpha_s == pytest.approx(k * a) and doubling.s_per_byte == pytest.approx(k * (b + GAMMA))
    assert halving.alpha_s == pytest.approx(2 * k * a)
    assert halving.s_per_byte == pytest.approx(2 * (n - 1) / n * b + (n - 1) / n * GAMMA)
    # the choice follows the size: doubling for tiny messages, halving for big ones (n > 2)
    assert m.allreduce_seconds("butterfly", 64, range(n)) == pytest.approx(doubling.seconds(64))
    assert m.allreduce_seconds("butterfly", 64 << 20, range(n)) == pytest.approx(
        min(doubling.seconds(64 << 20), halving.seconds(64 << 20)))


def test_butterfly_folds_non_powers_of_two():
    m = CostModel(flat_cluster(6))
    a, b = alpha_beta(1.0)
    # fold (S, summed) + 2 doubling rounds + unfold (S)
    line = m.line("butterfly", range(6))
    assert line.alpha_s == pytest.approx(4 * a) and line.s_per_byte == pytest.approx(4 * b + 3 * GAMMA)
    survivors, pairs = co.fold(6)
    assert pairs == [(0, 1), (2, 3)] and survivors == [1, 3, 4, 5]


def test_aggregator_on_a_worker_carries_everyone_through_its_link():
    n = 5
    a, b = alpha_beta(1.0)
    worker = CostModel(flat_cluster(n)).line("aggregator", range(n))
    assert worker.alpha_s == pytest.approx(2 * a)
    assert worker.s_per_byte == pytest.approx((n - 1) * b + (n - 1) * GAMMA)
    dedicated = CostModel(flat_cluster(n), aggregator_dedicated=True).line("aggregator", range(n))
    assert dedicated.s_per_byte == pytest.approx(b + (n - 1) * GAMMA)


def test_torus_3x2_and_2x3():
    m = CostModel(flat_cluster(6))
    a, b = alpha_beta(1.0)
    assert m.torus_shape(range(6)) == (3, 2)                  # the squarest grid, columns <= rows
    # rows reduce-scatter (1 round of S/2), a ring of 3 down each column on S/2 (4 rounds of S/6), rows all-gather
    line = m.line("torus2d", range(6))
    assert line.alpha_s == pytest.approx(6 * a)
    assert line.s_per_byte == pytest.approx((1 / 2 + 4 / 6 + 1 / 2) * b + (1 / 2 + 2 / 6) * GAMMA)
    # rows reduce-scatter (2 rounds of S/3), a ring of 2 down each column on S/3 (2 rounds of S/6), rows all-gather
    other = m.line("torus2d", range(6), shape=(2, 3))
    assert other.alpha_s == pytest.approx(6 * a)
    assert other.s_per_byte == pytest.approx((2 / 3 + 2 / 6 + 2 / 3) * b + (2 / 3 + 1 / 6) * GAMMA)
    with pytest.raises(UserError, match="does not hold 6 ranks"):
        m.allreduce_seconds("torus2d", S, range(6), shape=(4, 2))
    assert m.allreduce_seconds("torus2d", S, range(6), shape=(6, 1)) == pytest.approx(
        m.allreduce_seconds("ring", S, range(6)))


def test_flat_ring_across_hosts_is_priced_at_the_nic():
    m = CostModel(hier())
    a0, b0 = alpha_beta(40.0, 5.0)
    a1, b1 = alpha_beta(1.0, 50.0)
    # 14 rounds; each has two messages crossing hosts (3->4, 7->0), one per NIC and direction
    expected = 14 * a1 + 14 / 8 * S * b1 + 7 / 8 * S * GAMMA
    assert m.allreduce_seconds("ring", S, range(8)) == pytest.approx(expected)
    assert b0 < b1


def test_concurrent_messages_share_a_nic():
    m = CostModel(hier())
    a0, b0 = alpha_beta(40.0, 5.0)
    a1, b1 = alpha_beta(1.0, 50.0)
    line = m.line("butterfly", range(8))
    # distances 1 and 2 stay inside a host; at distance 4 all four ranks of a host cross its NIC at once
    assert line.alpha_s == pytest.approx(2 * a0 + a1)
    assert line.s_per_byte == pytest.approx(2 * b0 + 4 * b1 + 3 * GAMMA)


def test_hierarchical_reduce_scatter_across_all_gather():
    m = CostModel(hier())
    a0, b0 = alpha_beta(40.0, 5.0)
    a1, b1 = alpha_beta(1.0, 50.0)
    line = m.line("hierarchical", range(8))
    # inside: 3 + 3 rounds of S/4; across: 4 rings of 2 on S/4 each, all through one NIC: 2 rounds of 4 * S/8
    assert line.alpha_s == pytest.approx(6 * a0 + 2 * a1)
    assert line.s_per_byte == pytest.approx(6 / 4 * b0 + 1.0 * b1 + (3 / 4 + 1 / 8) * GAMMA)
    assert m.allreduce_seconds("hierarchical", 64 << 20, range(8)) < m.allreduce_seconds("ring", 64 << 20, range(8))


def test_hierarchical_with_unequal_groups_goes_through_leaders():
    m = CostModel(hier())
    ranks = (2, 3, 4, 5, 6)                      # 2 on host 0, 3 on host 1
    assert m.groups(ranks) == [[2, 3], [4, 5, 6]]
    rounds = m.rounds("hierarchical", ranks)
    leaders_ring = [r for r in rounds if {(s, d) for s, d, _ in r.messages} == {(2, 4), (4, 2)}]
    assert len(leaders_ring) == 2 and all(r.repeat == 1 for r in leaders_ring)
    assert m.allreduce_seconds("hierarchical", S, ranks) > 0


def test_edge_cases_cost_nothing_and_errors_are_clear():
    m = CostModel(flat_cluster(4))
    assert m.allreduce_seconds("ring", S, [0]) == 0 and m.allreduce_seconds("ring", 0, range(4)) == 0
    with pytest.raises(UserError, match="unknown all-reduce algorithm"):
        m.allreduce_seconds("telepathy", S, range(4))
    with pytest.raises(UserError, match="outside a cluster of 4"):
        m.allreduce_seconds("ring", S, range(6))
    with pytest.raises(UserError, match="no all-reduce algorithm"):
        m.fastest_allreduce(S, range(4), ())


def test_fastest_is_latency_bound_small_and_bandwidth_bound_large():
    m = CostModel(hier(4, 4))
    small, _ = m.fastest_allreduce(256, range(16))
    large, _ = m.fastest_allreduce(256 << 20, range(16))
    assert small in ("butterfly", "aggregator", "torus2d")
    # across 4 hosts a flat ring pushes 2(n-1)/n S = 1.875 S through each NIC; Rabenseifner
    # (nearest partner first), hierarchical and torus2d only 1.5 S
    assert large in ("hierarchical", "torus2d", "butterfly")
    for name in ("ring", "native", "aggregator"):
        assert m.allreduce_seconds(large, 256 << 20, range(16)) <= m.allreduce_seconds(name, 256 << 20, range(16))
    only = m.fastest_allreduce(256 << 20, range(16), ("ring", "butterfly"))
    assert only[0] in ("ring", "butterfly")


def test_p2p():
    m = CostModel(hier())
    a1, b1 = alpha_beta(1.0, 50.0)
    assert m.p2p_seconds(S, 1) == pytest.approx(a1 + S * b1)
    assert m.p2p_seconds(S, 1, share=0.5) == pytest.approx(a1 + 2 * S * b1)
    assert m.p2p_seconds(0, 1) == 0


def _cal(level: str, hosts: int = 2) -> Calibration:
    return Calibration(8, hosts, "gloo", "cpu", level, 2e-10, LinkFit(1e-4, 1e-8), {"ring": LinkFit(2e-4, 9e-9)})


def test_calibration_overrides_its_level_only():
    m = CostModel(hier(), _cal("network"))
    assert m.link(1, "ring") == LinkFit(2e-4, 9e-9)
    assert m.link(1, "butterfly") == LinkFit(1e-4, 1e-8)          # untimed: the measured link
    assert m.link(1) == LinkFit(1e-4, 1e-8)
    assert m.link(0, "ring") == LinkFit(*alpha_beta(40.0, 5.0))  # inner level stays nominal
    assert m.gamma == 2e-10
    assert CostModel(hier(), _cal("")).calibrations.keys() == {1}
    assert CostModel(hier(), _cal("", hosts=1)).calibrations.keys() == {0}


def test_calibration_errors():
    with pytest.raises(UserError, match="level 'rack'.*does not have"):
        CostModel(hier(), _cal("rack"))
    with pytest.raises(UserError, match="two calibrations measure level 'network'"):
        CostModel(hier(), [_cal("network"), _cal("")])


def test_model_of_a_calibrated_group():
    m = CostModel.from_calibration(_cal("network"))
    assert [lv.name for lv in m.cluster.levels] == ["host", "network"] and m.cluster.total_workers == 8
    assert m.link(1, "ring") == LinkFit(2e-4, 9e-9)
    flat = CostModel.from_calibration(Calibration(4, 4, "gloo", "cpu", "", 1e-10, LinkFit(1e-4, 1e-8), {}))
    assert len(flat.cluster.levels) == 1 and flat.cluster.total_workers == 4
