"""cost/computeterms.py and refine/computefit.py: the replicas' compute stretch and gradient accumulation as
stage terms, priced alike by the objective and the DP, and recovered by refinement from synthetic runs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit
from hybridpipe.partitioner.cost.computeterms import accumulation_ms, later_share, replica_factor
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.refine.computefit import ComputeStage, fit_accumulation, fit_replica_compute
from hybridpipe.partitioner.refine.refinement import predict_run, refine, refined_calibrations, refined_profile
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate, predict_step_ms
from hybridpipe.partitioner.search.options import Options
from tests.partitioner.synth import flat_cluster, make_profile
from tests.partitioner.synth_runs import synthetic_run

LAYERS = [(4.0, 8.0, 2_000_000, 100_000), (3.0, 6.0, 1_000_000, 2_000_000), (2.0, 4.0, 400_000, 3_000_000),
          (0.5, 1.0, 16_000, 60_000_000), (0.2, 0.4, 4_000, 4_000_000)]
PROFILE = make_profile(LAYERS, model="synthetic-terms")
CLUSTER = flat_cluster(4, gbps=1.0, latency_us=50)


def test_replica_factor_is_one_alone_exact_at_its_points_and_log_linear_between():
    pts = ((2, 1.2), (4, 1.5))
    assert replica_factor((), 3) == 1.0 and replica_factor(pts, 1) == 1.0
    assert replica_factor(pts, 2) == 1.2 and replica_factor(pts, 4) == 1.5
    assert replica_factor(pts, 3) == pytest.approx(1.2 + 0.3 * math.log(1.5) / math.log(2))
    assert replica_factor(pts, 8) == 1.5 and replica_factor(((4, 1.5),), 2) == 1.5      # held beyond the ends
    r = np.array([1, 2, 3, 4, 8])
    assert list(replica_factor(pts, r)) == [replica_factor(pts, int(x)) for x in r]      # arrays as numbers


def test_accumulation_counts_the_backwards_after_each_sync_periods_first():
    assert accumulation_ms(2e-10, 1e8, 8, 1) == pytest.approx(7 * 0.02 * 1e3)           # 0.2 ms/MB x 100 MB x 7
    assert accumulation_ms(2e-10, 1e8, 4, 4) == 0.0                                   # pipedream: none
    assert [later_share(k, 1) for k in (1, 2, 3, 8)] == [0.0, 0.5, 1.0, 1.0]


def terms_model(points=(), accumulate=0.0) -> CostModel:
    model = CostModel(CLUSTER)
    model.replica_compute, model.accumulate_s_per_byte = tuple(points), accumulate
    return model


OPTS = Options(get_schedule("1f1b"), 8, "sgd", math.inf)


def test_neutral_terms_leave_every_figure_bit_identical():
    """rho given as 1 at a replica count and an accumulation of 0 change no bit of any stage's figures."""
    costs = model_costs(PROFILE)
    for stages in ([StageSpec(0, 2, (0, 1)), StageSpec(3, 6, (2, 3))], [StageSpec(0, 6, (0, 1, 2, 3))],
                   [StageSpec(0, 1, (0,)), StageSpec(2, 3, (1,)), StageSpec(4, 6, (2, 3))]):
        plain = evaluate(costs, terms_model(), stages, OPTS)
        neutral = evaluate(costs, terms_model(((2, 1.0), (4, 1.0)), 0.0), stages, OPTS)
        assert neutral == plain
        assert predict_step_ms(neutral, OPTS) == predict_step_ms(plain, OPTS)


def test_rho_on_every_stage_is_the_profile_computing_rho_times_slower():
    """A plan whose every stage has r replicas, on a model with no weights (no sync lane to hide in the longer
    backward): rho(r) prices it as the profile with every node rho(r) times slower (a reference built without
    the term). Accumulation is what ``accumulation_ms`` adds per stage to the step, no more."""
    free = make_profile([(f, b, act, 0) for f, b, act, _ in LAYERS])
    stages = [StageSpec(0, 2, (0, 1)), StageSpec(3, 6, (2, 3))]
    slow = dataclasses.replace(free, nodes=tuple(dataclasses.replace(n, forward_ms=n.forward_ms * 1.3,
                                                                     backward_ms=n.backward_ms * 1.3)
                                                 for n in free.nodes))
    with_rho = evaluate(model_costs(free), terms_model(((2, 1.3),)), stages, OPTS)
    reference = evaluate(model_costs(slow), terms_model(), stages, OPTS)
    assert predict_step_ms(with_rho, OPTS) == pytest.approx(predict_step_ms(reference, OPTS), rel=1e-12)
    # the objective stretches a stage's own share of the trip only (the DP's terms stay per stage): exact for one
    dp = [StageSpec(0, 6, (0, 1, 2, 3))]
    assert evaluate(model_costs(free), terms_model(((4, 1.3),)), dp, OPTS).objective_ms == pytest.approx(
        evaluate(model_costs(slow), terms_model(), dp, OPTS).objective_ms, rel=1e-12)
    assert with_rho.objective_ms < reference.objective_ms
    costs = model_costs(PROFILE)
    one = [StageSpec(0, 2, (0,)), StageSpec(3, 6, (1,))]
    base = evaluate(costs, terms_model(), one, OPTS)
    acc = evaluate(costs, terms_model((), 3e-10), one, OPTS)
    for s, b, a in zip(one, base.stages, acc.stages, strict=True):
        assert a.term_ms - b.term_ms == pytest.approx(7 * 3e-10 * 1e3 * costs.param_bytes[s.first:s.last + 1].sum())
    assert predict_step_ms(acc, OPTS) > predict_step_ms(base, OPTS)


def test_fit_accumulation_takes_the_unreplicated_stages_weighted_by_their_bytes():
    def st(r, nbytes, first, later):
        return ComputeStage(0, 1, r, 8 // r, 1, nbytes, 1.0, later, first, later)
    stages = [st(1, 1e8, 100.0, 125.0), st(1, 2e8, 50.0, 100.0), st(1, 1e3, 1.0, 9.0), st(2, 1e8, 100.0, 160.0)]
    assert fit_accumulation(stages) == pytest.approx(2.5e-10)        # 0.25 ms/MB: the 1 kB stage's 8 weighs nothing
    assert fit_accumulation(stages[3:]) == pytest.approx(6e-10)      # only replicated ones: theirs
    assert fit_accumulation([st(1, 1e8, 100.0, 90.0)]) == 0.0        # never negative


def test_fit_replica_compute_recovers_rho_from_nodes_seen_both_ways():
    fwd, bwd = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])
    truth = np.array([1.1, 0.9, 1.4])

    def st(i, j, r):
        f, b = float((fwd[i:j + 1] * truth[i:j + 1]).sum()), float((bwd[i:j + 1] * truth[i:j + 1]).sum())
        rho = {1: 1.0, 2: 1.25, 4: 1.5}[r]
        return ComputeStage(i, j, r, 8 // r, 1, 0.0, f * rho, b * rho)
    stages = [st(0, 0, 1), st(1, 2, 1), st(0, 1, 1), st(2, 2, 1), st(0, 1, 2), st(2, 2, 2), st(0, 2, 4)]
    f_fwd, f_bwd, rho = fit_replica_compute(fwd, bwd, stages)
    assert dict(rho) == pytest.approx({2: 1.25, 4: 1.5}, rel=1e-4)
    assert f_fwd == pytest.approx(truth, rel=1e-4) and f_bwd == pytest.approx(truth, rel=1e-4)


NODE_TRUTH = (1.0, 1.3, 0.8, 1.1, 1.2, 1.0, 1.0)
LAYOUTS = ([StageSpec(0, 2, (0,)), StageSpec(3, 4, (1,)), StageSpec(5, 6, (2, 3))],
           [StageSpec(0, 3, (0, 1)), StageSpec(4, 6, (2, 3))],
           [StageSpec(0, 1, (0,)), StageSpec(2, 3, (1,)), StageSpec(4, 4, (2,)), StageSpec(5, 6, (3,))],
           [StageSpec(0, 4, (0, 1)), StageSpec(5, 6, (2, 3))],
           [StageSpec(0, 6, (0, 1, 2, 3))])


def planted_runs(**truth):
    """One synthetic run per layout: nodes at NODE_TRUTH, and the terms ``truth`` plants (synthetic_run)."""
    return [synthetic_run(PROFILE, CLUSTER, st, name=f"run{k}", node_factor=NODE_TRUTH.__getitem__, **truth)
            for k, st in enumerate(LAYOUTS)]


def test_refinement_recovers_planted_rho_and_accumulation_and_the_calibration_carries_them():
    """Runs whose replicated stages compute 1.2x (2 replicas) and 1.35x (4) what their nodes do, and whose later
    backwards cost 0.3 ms per MB more: refine finds both (by default), and the node factors without them."""
    truth = {"replica_factor": lambda r: {1: 1.0, 2: 1.2, 4: 1.35}[r], "accumulate_ms_per_byte": 0.3e-6}
    runs = planted_runs(**truth)
    ref = refine(PROFILE, CLUSTER, (), runs, terms=("replicas", "accumulation"))
    assert ref.accumulate_s_per_byte == pytest.approx(0.3e-9, rel=1e-6)
    assert dict(ref.replica_compute) == pytest.approx({2: 1.2, 4: 1.35}, rel=1e-3)
    clean = refine(PROFILE, CLUSTER, (), planted_runs())     # the same runs without the terms, the plain fit
    assert ref.backward_factor == pytest.approx(clean.backward_factor, rel=1e-4)
    assert ref.forward_factor == pytest.approx(clean.forward_factor, rel=1e-4)
    assert np.array(ref.backward_factor[1:6]) == pytest.approx(NODE_TRUTH[1:6], rel=1e-2)
    cal = refined_calibrations(CLUSTER, (), ref)[-1]
    assert cal.replica_compute == ref.replica_compute and cal.accumulate_s_per_byte == ref.accumulate_s_per_byte
    again = Calibration.from_dict(cal.to_dict())
    assert again.replica_compute == cal.replica_compute and again.accumulate_s_per_byte == cal.accumulate_s_per_byte
    assert refine(PROFILE, CLUSTER, (), runs) == ref           # both terms are refinement's default
    # without the terms the node factors hold them, mixed: a node seen replicated and not gets neither
    plain = refine(PROFILE, CLUSTER, (), runs, terms=())
    assert plain.replica_compute == () and plain.accumulate_s_per_byte == 0.0
    assert max(abs(f / t - 1) for f, t in zip(plain.backward_factor[1:6], clean.backward_factor[1:6],
                                               strict=True)) > 0.05


def test_a_plain_calibration_writes_no_term_fields():
    cal = Calibration(4, 4, "gloo", "cpu", "net", 1e-10, LinkFit(1e-4, 1e-8), {})
    d = cal.to_dict()
    assert "replica_compute" not in d and "accumulate_s_per_byte" not in d and d["format"] == 1
    refined = dataclasses.replace(cal, replica_compute=((2, 1.1),))
    assert refined.refined and Calibration.from_dict(refined.to_dict()).replica_compute == ((2, 1.1),)


def test_predict_run_counts_the_terms_of_a_refined_calibration():
    runs = planted_runs()
    ref = refine(PROFILE, CLUSTER, (), runs)
    prof, cals = refined_profile(PROFILE, ref), refined_calibrations(CLUSTER, (), ref)
    base = predict_run(prof, CLUSTER, cals, runs[1])
    stretched = [dataclasses.replace(cals[-1], replica_compute=((2, 1.5),))]
    assert predict_run(prof, CLUSTER, stretched, runs[1]) > base
    assert predict_run(prof, CLUSTER, stretched, runs[2]) == predict_run(prof, CLUSTER, cals, runs[2])  # no replicas


def test_a_held_out_replicated_plans_compute_is_predicted_with_the_terms_and_not_without():
    """Refined from the other layouts' runs, the held-out 0-4x2 | 5-6x2's forward and (first) backward per
    micro-batch are what it measured with the terms, and off by the stretch without them."""
    truth = {"replica_factor": lambda r: {1: 1.0, 2: 1.2, 4: 1.35}[r], "accumulate_ms_per_byte": 0.3e-6}
    runs = planted_runs(**truth)
    held, others = runs[3], runs[:3] + runs[4:]
    errors = {}
    for terms in ((), ("replicas", "accumulation")):
        ref = refine(PROFILE, CLUSTER, (), others, terms=terms)
        prof, cals = refined_profile(PROFILE, ref), refined_calibrations(CLUSTER, (), ref)
        model = CostModel(CLUSTER, list(cals))
        costs = model_costs(prof).slowed(model.compute_slowdown)
        ev = evaluate(costs, model, [StageSpec(s.first, s.last, s.ranks) for s in held.stages], OPTS)
        errors[terms] = max(max(abs(e.forward_ms / s.forward_ms - 1), abs(e.backward_ms / s.first_backward_ms - 1))
                            for e, s in zip(ev.stages, held.stages, strict=True))
    assert errors[("replicas", "accumulation")] < 0.01 < 0.05 < errors[()]


@pytest.mark.parametrize("points", [[[2, 1.1], [2, 1.2]], [[1, 1.1]], [[2, 0]], [[2]], "x"])
def test_a_calibrations_bad_replica_points_are_one_clear_error(points):
    d = dataclasses.replace(Calibration(4, 4, "gloo", "cpu", "net", 1e-10, LinkFit(1e-4, 1e-8), {}),
                            replica_compute=((2, 1.1),)).to_dict()
    d["replica_compute"] = points
    with pytest.raises(UserError, match="replica_compute"):
        Calibration.from_dict(d)


def test_partition_refine_terms_fits_them_from_run_folders_and_saves_them(tmp_path, capsys):
    """``partition --refine RUN... --save-refined DIR``: both terms (the default; ``--refine-terms none``: neither)
    fitted from the runs' own folders (their timelines) land in the refined calibration a later plan takes; an
    unknown term, or the flag without --refine, is one line and exit 2."""
    import json

    from hybridpipe.cli import main
    from hybridpipe.partitioner.cost.calibration import load_calibration
    from hybridpipe.profiles.format import save_profile

    truth = {"replica_factor": lambda r: {1: 1.0, 2: 1.2, 4: 1.35}[r], "accumulate_ms_per_byte": 0.3e-6}
    dirs = [tmp_path / f"run{k}" for k in range(len(LAYOUTS))]
    for k, (st, d) in enumerate(zip(LAYOUTS, dirs, strict=True)):
        synthetic_run(PROFILE, CLUSTER, st, name=f"run{k}", node_factor=NODE_TRUTH.__getitem__, write_to=d, **truth)
    profile = save_profile(PROFILE, tmp_path / "p.json")
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(CLUSTER.to_dict()))
    base = ["partition", str(profile), "--cluster", str(cluster), "-o", str(tmp_path / "plan.json"), "-q"]
    assert main([*base, "--refine", *map(str, dirs), "--save-refined", str(tmp_path / "ref")]) == 0
    cal = load_calibration(tmp_path / "ref" / "calibration.json")
    assert dict(cal.replica_compute) == pytest.approx({2: 1.2, 4: 1.35}, rel=1e-2)
    assert cal.accumulate_s_per_byte == pytest.approx(0.3e-9, rel=1e-2)
    assert main([*base, "--refine", *map(str, dirs), "--refine-terms", "replicas",
                 "--save-refined", str(tmp_path / "rho")]) == 0
    rho = load_calibration(tmp_path / "rho" / "calibration.json")
    assert rho.replica_compute and rho.accumulate_s_per_byte == 0.0
    (tmp_path / "latest").symlink_to(dirs[-1])          # as launch's runs/latest: the same run, named twice
    capsys.readouterr()
    assert main([*base, "--refine", *map(str, dirs), str(tmp_path / "latest"), "-q"]) == 0
    out = capsys.readouterr().out
    assert f"refined from {len(dirs)} run(s)" in out
    # the plan's step by the critical path the leftover terms were fitted under, beside the closed form it records
    import re

    from hybridpipe.commands.refining import simulated_step_ms
    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.partitioner.refine.refinement import predict_stages
    from hybridpipe.partitioner.search.objective import StageSpec
    from hybridpipe.profiles.format import load_profile
    critical, closed = map(float, re.search(r"this plan takes ([\d.]+) ms a step \(the search's closed form, which "
                                            r"the plan records: ([\d.]+) ms\)", out).groups())
    plan = load_plan(tmp_path / "plan.json")
    assert closed == pytest.approx(plan.predicted_step_ms, abs=0.05)
    ref = tmp_path / "ref"
    prof, cals = load_profile(ref / "profile.json"), [load_calibration(ref / "calibration.json")]
    specs = [StageSpec(st.first_node, st.last_node, st.ranks) for st in plan.stages]
    expected = predict_stages(prof, CLUSTER, cals, specs, plan.schedule, plan.micro_batches, plan.optimizer,
                              step=simulated_step_ms)
    assert critical == pytest.approx(expected, abs=0.05)
    assert main([*base, "--refine", *map(str, dirs), "--refine-terms", "none",
                 "--save-refined", str(tmp_path / "plain")]) == 0
    plain = load_calibration(tmp_path / "plain" / "calibration.json")
    assert plain.replica_compute == () and plain.accumulate_s_per_byte == 0.0
    capsys.readouterr()
    for bad in (["--refine", str(dirs[0]), "--refine-terms", "rho"], ["--refine-terms", "replicas"]):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("replicas" in err or "--refine" in err), err
