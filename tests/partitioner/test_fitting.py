"""Fitting alpha/beta from timed samples: NNLS against enumeration, recovery of known costs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import LinkFit, Sample, load_calibration, save_calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.fitting import fit_calibration, fit_link, measurement_model, nnls, refit
from hybridpipe.partitioner.plan import ALGORITHMS

GAMMA = 1 / 4e9
SIZES = (4096, 65536, 1 << 20, 16 << 20, 64 << 20)


def nnls_by_enumeration(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest residual over every set of free columns whose solution is non-negative."""
    best = float(np.linalg.norm(b))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x >= 0).all():
                best = min(best, float(np.linalg.norm(a[:, cols] @ x - b)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 3), st.integers(0, 2 ** 32 - 1))
def test_nnls_matches_enumeration(rows, cols, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(rows, cols)) * rng.choice([1e-6, 1.0, 1e6], size=cols)
    b = rng.normal(size=rows)
    x = nnls(a, b)
    assert (x >= 0).all()
    assert np.linalg.norm(a @ x - b) <= nnls_by_enumeration(a, b) * (1 + 1e-6) + 1e-12


def samples_for(algorithm: str, world: int, hosts: int, fit: LinkFit) -> list[Sample]:
    """What a group whose measured level costs ``fit`` would time, per the model itself."""
    model = measurement_model(world, hosts, gamma=GAMMA)
    level = len(model.cluster.levels) - 1
    model.calibrations[level] = _only(fit, algorithm, world, hosts)
    ranks = list(range(world))
    if algorithm == "p2p":
        return [Sample("p2p", s, fit.alpha_s + s * fit.beta_s_per_byte) for s in SIZES]
    return [Sample(algorithm, s, model.allreduce_seconds(algorithm, s, ranks)) for s in SIZES]


def _only(fit, algorithm, world, hosts):
    from hybridpipe.partitioner.cost.calibration import Calibration

    return Calibration(world, hosts, "gloo", "cpu", "", GAMMA, fit, {algorithm: fit})


@pytest.mark.parametrize("algorithm", ALGORITHMS + ("p2p",))
@pytest.mark.parametrize("world,hosts", [(4, 4), (6, 6), (8, 2), (4, 1)])
def test_fit_recovers_known_costs(algorithm, world, hosts):
    truth = LinkFit(120e-6, 1 / 0.117e9)         # ~0.94 Gbit/s after protocol overhead
    fit = fit_link(samples_for(algorithm, world, hosts, truth), algorithm, world, GAMMA, hosts)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-4)
    assert fit.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-4)
    assert fit.rel_error < 1e-6


def test_fit_clamps_at_zero_and_reports_its_error():
    # times that fall with size cannot be fitted with beta >= 0: beta is clamped, the error shows it
    samples = [Sample("ring", s, 1e-3 - s * 1e-12) for s in SIZES]
    fit = fit_link(samples, "ring", 4, gamma=0.0)
    assert fit.beta_s_per_byte == 0.0 and fit.alpha_s > 0 and fit.rel_error > 0.01


def test_fit_calibration_round_trip(tmp_path):
    truth = LinkFit(80e-6, 9e-9)
    samples = [s for a in ("ring", "butterfly", "native", "p2p") for s in samples_for(a, 4, 4, truth)]
    cal = fit_calibration(samples, world_size=4, hosts=4, backend="gloo", device="cpu", gamma_s_per_byte=GAMMA,
                          level="network", created="now", notes=("test",))
    assert set(cal.algorithms) == {"ring", "butterfly", "native"}
    assert cal.p2p.beta_s_per_byte == pytest.approx(9e-9, rel=1e-4)
    back = load_calibration(save_calibration(cal, tmp_path / "cal.json"))
    assert back == cal
    assert refit(back).algorithms["ring"].alpha_s == pytest.approx(80e-6, rel=1e-4)
    # the fitted calibration drives the model at its level
    model = CostModel.from_calibration(back)
    assert model.allreduce_seconds("ring", 1 << 20, range(4)) == pytest.approx(
        next(s.seconds for s in samples if s.algorithm == "ring" and s.bytes == 1 << 20), rel=1e-6)


def test_fit_errors():
    with pytest.raises(UserError, match="at least two timed sizes"):
        fit_link([Sample("ring", 4096, 1e-3)], "ring", 4, GAMMA)
    with pytest.raises(UserError, match="unknown algorithm"):
        fit_calibration([Sample("teleport", 1, 1.0)], world_size=2, hosts=2, backend="gloo", device="cpu",
                        gamma_s_per_byte=GAMMA)
    with pytest.raises(UserError, match="no samples"):
        fit_calibration([], world_size=2, hosts=2, backend="gloo", device="cpu", gamma_s_per_byte=GAMMA)
    with pytest.raises(UserError, match="1 <= hosts <= world_size"):
        measurement_model(2, 3)
