"""Structural sanity of the alpha-beta-gamma cost model against hand-computed values."""

import math

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.calibration import Sample
from hybridpipe.partitioner.cluster import Cluster
from hybridpipe.partitioner.costmodel import NOMINAL_SOFTWARE_ALPHA_S, CostModel
from hybridpipe.partitioner.fitting import fit_link


def flat(n, gbps=1.0, latency_us=0.0):
    return Cluster.from_dict({"levels": [{"name": "net", "workers": n, "bandwidth_gbps": gbps,
                                          "latency_us": latency_us}], "memory_gb": 1})


def test_ring_matches_textbook_formula():
    m = CostModel(flat(4))
    S = 1 << 20
    alpha, beta = NOMINAL_SOFTWARE_ALPHA_S, 8 / 1e9
    expected = 6 * alpha + 1.5 * S * beta + 0.75 * S * m.gamma
    assert m.allreduce_seconds("ring", S, range(4)) == pytest.approx(expected)


def test_butterfly_wins_small_ring_not_beaten_large_on_non_power_of_two():
    m = CostModel(flat(6))
    assert m.fastest_allreduce(1024, range(6))[0] in ("butterfly", "torus2d", "aggregator")
    big = 64 << 20
    assert m.allreduce_seconds("ring", big, range(6)) < m.allreduce_seconds("butterfly", big, range(6))


def test_single_rank_and_empty_cost_nothing():
    m = CostModel(flat(4))
    assert m.allreduce_seconds("ring", 1 << 20, [0]) == 0
    assert m.allreduce_seconds("ring", 0, range(4)) == 0


def test_fit_recovers_alpha_beta():
    gamma = 1 / 4e9
    alpha, beta = 80e-6, 9e-9
    samples = [Sample("ring", s, 6 * alpha + 1.5 * s * beta + 0.75 * s * gamma) for s in (4096, 1 << 16, 1 << 20, 1 << 24)]
    fit = fit_link(samples, "ring", 4, gamma)
    assert math.isclose(fit.alpha_s, alpha, rel_tol=1e-6) and math.isclose(fit.beta_s_per_byte, beta, rel_tol=1e-6)


def test_unknown_algorithm_is_a_user_error():
    with pytest.raises(UserError, match="unknown all-reduce algorithm"):
        CostModel(flat(4)).allreduce_seconds("telepathy", 100, range(4))
