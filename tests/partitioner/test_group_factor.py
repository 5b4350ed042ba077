"""All-reduce factors per group size (cost/groupfactor.py, refine/sync.py ``fit_groups``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridpipe.partitioner.cost.calibration import Calibration, load_calibration, save_calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.groupfactor import group_factor, least_group_factor, size_factor
from hybridpipe.partitioner.refine.refinement import predict_run, refine, refined_calibrations, refined_profile
from hybridpipe.partitioner.search.objective import StageSpec
from tests.partitioner.synth import flat_cluster, make_profile
from tests.partitioner.synth_runs import synthetic_run

GROUPS = ((2, ((1e3, 2.0), (1e6, 4.0))), (8, ((1e3, 0.5), (1e6, 1.0))))


def test_a_group_size_the_runs_had_takes_its_own_points_and_the_ends_the_nearest_sizes():
    for g, pts in GROUPS:
        for b in (10.0, 1e3, 3e4, 1e6, 1e9):
            assert group_factor(GROUPS, b, g) == pytest.approx(size_factor(pts, b))
    assert group_factor(GROUPS, 1e6, 1) == pytest.approx(4.0)
    assert group_factor(GROUPS, 1e6, 64) == pytest.approx(1.0)
    assert group_factor((), 1e6, 4) == 1.0


def test_between_sizes_the_log_factor_is_linear_in_log_group_size():
    # closed form: at g = 4 (halfway between 2 and 8 in log g) the geometric mean of the two sizes' factors
    assert group_factor(GROUPS, 1e3, 4) == pytest.approx(math.sqrt(2.0 * 0.5))
    assert group_factor(GROUPS, 1e6, 4) == pytest.approx(math.sqrt(4.0 * 1.0))
    w = math.log(3 / 2) / math.log(4)
    assert group_factor(GROUPS, 1e6, 3) == pytest.approx(4.0 ** (1 - w) * 1.0 ** w)
    many = np.array([1e3, 3e4, 1e6])
    assert np.allclose(group_factor(GROUPS, many, 4), [group_factor(GROUPS, float(b), 4) for b in many])


def test_the_least_factor_bounds_every_group_size_from_below():
    sizes = np.geomspace(10, 1e9, 25)
    floor = least_group_factor(GROUPS, (), sizes)
    for g in range(1, 70):                                   # brute force over group sizes
        assert np.all(floor <= group_factor(GROUPS, sizes, g) * (1 + 1e-12))
    assert least_group_factor((), ((1e3, 3.0),), 5e3) == pytest.approx(3.0)


def test_refinement_learns_each_group_size_and_a_model_prices_each_by_its_own(tmp_path):
    # the same layers' all-reduces run 3x their price over 2 replicas and as priced over 4
    prof = make_profile([(5.0, 10.0, 100_000, 4_000_000)] * 6, model="groups")
    cluster = flat_cluster(8, gbps=1.0, latency_us=200)
    run = synthetic_run(prof, cluster, [StageSpec(0, 2, (0, 1)), StageSpec(3, 5, (2, 3, 4, 5))],
                        group_factor=lambda g: 3.0 if g == 2 else 1.0)
    ref = refine(prof, cluster, (), [run])
    learnt = dict(ref.allreduce_slowdown_groups)
    assert sorted(learnt) == [2, 4]
    assert learnt[2][0][1] == pytest.approx(3.0, rel=0.05)
    assert learnt[4][0][1] == pytest.approx(1.0, rel=0.05)
    cals = refined_calibrations(cluster, (), ref)
    path = save_calibration(cals[-1], tmp_path / "refined.json")       # carried through the file
    model = CostModel(cluster, [load_calibration(path)])
    base = CostModel(cluster)
    for ranks, factor in (((0, 1), 3.0), ((0, 1, 2, 3), 1.0), (tuple(range(8)), 1.0)):
        assert model.allreduce_seconds("ring", 4e6, ranks) == pytest.approx(
            factor * base.allreduce_seconds("ring", 4e6, ranks), rel=0.05)
    # the run re-predicted with what was learnt matches what it measured
    truth = synthetic_run(prof, cluster, [StageSpec(0, 5, (0, 1))], group_factor=lambda g: 3.0)
    assert predict_run(refined_profile(prof, ref), cluster, cals, truth) > predict_run(prof, cluster, (), truth)


def test_one_group_size_keeps_the_pooled_classes_only():
    prof = make_profile([(5.0, 10.0, 100_000, 4_000_000)] * 4, model="one")
    cluster = flat_cluster(4, gbps=1.0, latency_us=200)
    run = synthetic_run(prof, cluster, [StageSpec(0, 1, (0, 1)), StageSpec(2, 3, (2, 3))],
                        allreduce_factor=lambda b: 2.0)
    ref = refine(prof, cluster, (), [run])
    assert ref.allreduce_slowdown_groups == ()
    assert ref.allreduce_slowdown[0][1] == pytest.approx(2.0, rel=0.05)


def test_a_calibration_with_group_points_round_trips_and_bad_ones_are_refused(tmp_path):
    from hybridpipe.errors import UserError
    from hybridpipe.partitioner.cost.calibration import LinkFit

    cal = Calibration(4, 4, "gloo", "cpu", "", 1e-10, LinkFit(1e-4, 1e-8), {"ring": LinkFit(1e-4, 1e-8)},
                      allreduce_slowdown_groups=GROUPS)
    back = load_calibration(save_calibration(cal, tmp_path / "c.json"))
    assert back.allreduce_slowdown_groups == GROUPS and back.refined
    from hybridpipe.commands.show import render_calibration
    assert "over 8 ranks: ~1000 B 0.50x, ~976.6 KiB 1.00x" in render_calibration(back)
    d = cal.to_dict()
    d["allreduce_slowdown_groups"] = {"1": [[1e3, 2.0]]}
    with pytest.raises(UserError, match="group sizes of 2"):
        Calibration.from_dict(d)


def test_a_size_class_seen_only_on_one_group_size_prices_the_others_by_their_own_level():
    # big layers only on 2-replica stages; small ones on 2 and 4: factor = bytes part (2 big, 1 small) x group part
    # (1.5 at 2 ranks, 1 at 4), so the 4-rank group's big class is 2 x 1 (separable), not the 2-rank 3.0
    prof = make_profile([(5.0, 10.0, 100_000, 20_000_000)] * 2 + [(5.0, 10.0, 100_000, 200_000)] * 4, model="sep")
    cluster = flat_cluster(8, gbps=1.0, latency_us=200)
    stages = [StageSpec(0, 2, (0, 1)), StageSpec(3, 4, (2, 3)), StageSpec(5, 7, (4, 5, 6, 7))]   # node 0: input
    run = synthetic_run(prof, cluster, stages,
                        allreduce_factor=lambda b: 2.0 if b > 1e6 else 1.0,
                        group_factor=lambda g: 1.5 if g == 2 else 1.0)
    learnt = {g: dict(pts) for g, pts in refine(prof, cluster, (), [run]).allreduce_slowdown_groups}
    (small, big) = sorted(learnt[2])
    assert learnt[2][big] == pytest.approx(3.0, rel=0.05) and learnt[2][small] == pytest.approx(1.5, rel=0.05)
    assert learnt[4][big] == pytest.approx(2.0, rel=0.05) and learnt[4][small] == pytest.approx(1.0, rel=0.05)
