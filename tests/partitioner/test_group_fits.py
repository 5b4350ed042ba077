"""All-reduce fits per group size (calibration format 3, ``bench-allreduce --group-sizes``): the fit of each
size recovered from samples, the files of formats 1, 2 and 3 read, and the cost model pricing a group of n
ranks with the fit of n (the textbook ring with that fit; interpolated in log n between measured sizes),
the batched and bounding paths agreeing with it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.blocklines import block_lines
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, Sample, load_calibration, save_calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.fitting import fit_calibration
from hybridpipe.partitioner.search.lanes import ring_bounds, sync_floor
from tests.partitioner.synth import flat_cluster

GAMMA = 1 / 4e9
SIZES = [1 << k for k in range(12, 27, 2)]
F2, F4, F8 = LinkFit(300e-6, 16e-9), LinkFit(100e-6, 8e-9), LinkFit(150e-6, 10e-9)


def ring_s(fit: LinkFit, n: int, nbytes: float) -> float:
    """The textbook ring on n ranks, one per host: 2(n-1) alpha + 2(n-1)/n S beta + (n-1)/n S gamma."""
    return 2 * (n - 1) * fit.alpha_s + 2 * (n - 1) / n * nbytes * fit.beta_s_per_byte + (n - 1) / n * nbytes * GAMMA


def cal8() -> Calibration:
    return Calibration(8, 8, "gloo", "cpu", "", GAMMA, LinkFit(50e-6, 8e-9), {"ring": F8, "butterfly": F8},
                       group_fits={2: {"ring": F2}, 4: {"ring": F4, "butterfly": F4}})


def test_fit_per_group_size_recovers_each_sizes_costs():
    # samples of the ring timed on 2 and 4 ranks (first ranks of a 4-host group) and on the whole, as the
    # textbook formula prices them with a different alpha, beta per size
    samples = [Sample("ring", s, ring_s(F4, 4, s)) for s in SIZES]
    samples += [Sample("ring", s, ring_s(F2, 2, s), ranks=2) for s in SIZES]
    samples += [Sample("p2p", s, 1e-4 + s * 8e-9) for s in SIZES]
    cal = fit_calibration(samples, world_size=4, hosts=4, backend="gloo", device="cpu", gamma_s_per_byte=GAMMA)
    assert set(cal.group_fits) == {2}
    for got, want in ((cal.algorithms["ring"], F4), (cal.group_fits[2]["ring"], F2)):
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=1e-4)
        assert got.beta_s_per_byte == pytest.approx(want.beta_s_per_byte, rel=1e-4)
    assert cal.p2p.beta_s_per_byte == pytest.approx(8e-9, rel=1e-4)
    with pytest.raises(UserError, match="groups of 2 to 4 ranks"):
        fit_calibration([*samples, Sample("ring", 4096, 1e-3, ranks=6), Sample("ring", 1 << 20, 1e-2, ranks=6)],
                        world_size=4, hosts=4, backend="gloo", device="cpu", gamma_s_per_byte=GAMMA)


def test_fit_for_a_group_size_exact_interpolated_and_beyond():
    cal = cal8()
    assert cal.algorithm_fit("ring", 2) == F2 and cal.algorithm_fit("ring", 4) == F4
    assert cal.algorithm_fit("ring", 8) == cal.algorithm_fit("ring") == F8
    w = (math.log(6) - math.log(4)) / (math.log(8) - math.log(4))       # 6 ranks: between 4 and 8 in log n
    six = cal.algorithm_fit("ring", 6)
    assert six is not None
    assert six.alpha_s == pytest.approx(F4.alpha_s + w * (F8.alpha_s - F4.alpha_s))
    assert six.beta_s_per_byte == pytest.approx(F4.beta_s_per_byte + w * (F8.beta_s_per_byte - F4.beta_s_per_byte))
    assert cal.algorithm_fit("ring", 16) == F8                            # beyond: the nearest size's
    assert cal.algorithm_fit("butterfly", 2) == F4                        # butterfly measured at 4 and 8 only
    assert cal.algorithm_fit("torus2d", 2) is None                        # never measured


def test_the_model_prices_a_group_with_the_fit_of_its_size():
    model = CostModel(flat_cluster(8), cal8())
    for n, fit in ((2, F2), (4, F4), (8, F8)):
        for ranks in (range(n), range(8 - n, 8)):                         # any n ranks, not only the first
            assert model.allreduce_seconds("ring", 1 << 24, ranks) == pytest.approx(ring_s(fit, n, 1 << 24))
    six = cal8().algorithm_fit("ring", 6)
    assert six is not None
    assert model.allreduce_seconds("ring", 1 << 24, range(6)) == pytest.approx(ring_s(six, 6, 1 << 24))
    # untimed algorithms and p2p stay on the measured link, whatever the group
    assert model.link(0, "torus2d", 2) == model.link(0) == LinkFit(50e-6, 8e-9)
    # without group fits (formats 1, 2) every size gets the world's fit, as before
    plain = CostModel(flat_cluster(8), Calibration(8, 8, "gloo", "cpu", "", GAMMA, LinkFit(50e-6, 8e-9), {"ring": F8}))
    assert plain.allreduce_seconds("ring", 1 << 24, range(2)) == pytest.approx(ring_s(F8, 2, 1 << 24))


def test_batched_and_bounding_paths_use_the_same_fits():
    model = CostModel(flat_cluster(8), cal8())
    offsets, sizes = np.array([0, 1, 2, 0]), np.array([2, 3, 4, 8])
    names, alpha, per_byte = block_lines(model, 1, 8, offsets, sizes, ("ring", "butterfly"))
    for g, (o, s) in enumerate(zip(offsets.tolist(), sizes.tolist(), strict=True)):
        ranks = list(range(o, o + s))
        for v, name in enumerate(names):
            ref = model.priced_line(name, ranks, halving=v == 2)
            assert (alpha[g, v], per_byte[g, v]) == (ref.alpha_s, ref.s_per_byte)
    # the ring bound is the ring at each size; the floor is below every size's price
    a, b = ring_bounds(model, 1, 8, 1, ("ring",))
    for n in (2, 3, 4, 8):
        ln = model.line("ring", range(n))
        assert a[n, 0] == pytest.approx(ln.alpha_s) and b[n, 0] == pytest.approx(ln.s_per_byte)
    nbytes = np.array([1e3, 1e6, 1e8])
    for n in (2, 4, 8):
        floor = sync_floor(model, 0, n, ("ring", "butterfly"), nbytes) / 1e3
        best = [min(model.allreduce_seconds(x, s, range(n)) for x in ("ring", "butterfly")) for s in nbytes]
        assert (floor <= np.array(best)).all()


def test_formats_1_2_and_3_are_read(tmp_path):
    cal = cal8()
    back = load_calibration(save_calibration(cal, tmp_path / "new.json"))
    assert back == cal and json.loads((tmp_path / "new.json").read_text())["format"] == 3
    refined = Calibration(8, 8, "gloo", "cpu", "", GAMMA, LinkFit(5e-5, 8e-9), {"ring": F8},
                          (Sample("ring", 4096, 1e-3, ranks=2),), allreduce_slowdown=((1e6, 1.5),),
                          compute_slowdown=1.2, group_fits={2: {"ring": F2}})
    assert load_calibration(save_calibration(refined, tmp_path / "r.json")) == refined
    old = {"kind": "calibration", "format": 1, "world_size": 4, "hosts": 4, "backend": "gloo", "device": "cpu",
           "gamma_s_per_byte": GAMMA, "p2p": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-9},
           "algorithms": {"ring": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-9}},
           "samples": [{"algorithm": "ring", "bytes": 4096, "seconds": 1e-3}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    one = load_calibration(tmp_path / "old.json")
    assert one.group_fits == {} and one.samples[0].ranks == 0 and not one.refined
    assert json.loads(json.dumps(one.to_dict()))["format"] == 1 and "group_fits" not in one.to_dict()
    two = {**old, "format": 2, "allreduce_slowdown": [[1e6, 1.5]], "compute_slowdown": 1.1}
    (tmp_path / "two.json").write_text(json.dumps(two))
    assert load_calibration(tmp_path / "two.json").allreduce_slowdown == ((1e6, 1.5),)
    bad = {**old, "format": 3, "group_fits": {"1": {"ring": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-9}}}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="group sizes of 2 ranks or more"):
        load_calibration(tmp_path / "bad.json")


def test_separate_runs_on_the_first_ranks_join_as_group_fits():
    from hybridpipe.partitioner.cost.fitting import with_groups
    whole = fit_calibration([Sample("ring", s, ring_s(F4, 4, s)) for s in SIZES], world_size=4, hosts=4,
                            backend="gloo", device="cpu", gamma_s_per_byte=GAMMA)
    two = fit_calibration([*(Sample("ring", s, ring_s(F2, 2, s)) for s in SIZES),
                           *(Sample("p2p", s, 1.0) for s in SIZES)], world_size=2, hosts=2, backend="gloo",
                          device="cpu", gamma_s_per_byte=GAMMA)
    both = with_groups(whole, [two])
    assert both.algorithms == whole.algorithms and both.p2p == whole.p2p
    assert both.group_fits[2]["ring"].beta_s_per_byte == pytest.approx(F2.beta_s_per_byte, rel=1e-4)
    assert {s.ranks for s in both.samples} == {0, 2} and all(s.algorithm != "p2p" for s in both.samples if s.ranks)
    with pytest.raises(UserError, match="a different group of 2 to 3 ranks"):
        with_groups(whole, [two, two])
