"""Per-step overhead in the objective: optimizer steps and compute lost to communication."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.planner import build_plan
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate, predict_step_ms
from hybridpipe.partitioner.search.options import Options
from hybridpipe.pipeline.simulator import simulate
from tests.partitioner.synth import flat_cluster, make_profile

LAYERS = [(2.0, 4.0, 1_000_000, 4_000_000), (1.0, 2.0, 500_000, 12_000_000)]


def setup(step_ms: float, interference: float):
    profile = make_profile(LAYERS)
    costs = dataclasses.replace(model_costs(profile), step_ms=(("sgd", step_ms), ("adam", 3 * step_ms)))
    model = CostModel(flat_cluster(3, gbps=10.0))
    model.interference_s_per_byte = interference
    return profile, costs, model


STAGES = (StageSpec(0, 1, (0, 1)), StageSpec(2, 3, (2,)))


def test_optimizer_step_is_shared_by_parameter_bytes_and_charged_once_per_sync():
    _, costs, model = setup(32.0, 0.0)
    ev = evaluate(costs, model, STAGES, Options(get_schedule("1f1b"), 4, "sgd"))
    assert [s.overhead_ms for s in ev.stages] == pytest.approx([8.0, 24.0])     # 4 MB and 12 MB of 16 MB
    adam = evaluate(costs, model, STAGES, Options(get_schedule("1f1b"), 4, "adam"))
    assert [s.overhead_ms for s in adam.stages] == pytest.approx([24.0, 72.0])
    pipedream = evaluate(costs, model, STAGES, Options(get_schedule("pipedream"), 4, "sgd"))
    assert [s.overhead_ms for s in pipedream.stages] == pytest.approx([8.0 * 2, 24.0 * 4])  # a step per minibatch


def test_compute_lost_to_communication_counts_the_ring_and_the_activations():
    _, costs, model = setup(0.0, 1e-9)
    ev = evaluate(costs, model, STAGES, Options(get_schedule("1f1b"), 4, "sgd"))
    a_out, g_in = costs.output_bytes(1)
    ring = 2 * (2 - 1) / 2 * 4_000_000                 # stage 0: 2 replicas, 4 MB of weights
    k0 = 2                                             # 4 micro-batches over 2 replicas
    assert ev.stages[0].overhead_ms == pytest.approx(1e-9 * 1e3 * (ring + k0 * (a_out + g_in) / 2))
    a_in, g_out = costs.input_bytes(2)
    assert ev.stages[1].overhead_ms == pytest.approx(1e-9 * 1e3 * 4 * (a_in + g_out) / 2)


def test_overhead_adds_to_the_busy_time_the_prediction_and_the_simulation():
    profile, plain_costs, plain_model = setup(0.0, 0.0)
    _, costs, model = setup(60.0, 5e-9)
    opts = Options(get_schedule("gpipe"), 4, "sgd")
    before, after = evaluate(plain_costs, plain_model, STAGES, opts), evaluate(costs, model, STAGES, opts)
    for b, a in zip(before.stages, after.stages, strict=True):
        assert a.busy_ms == pytest.approx(b.busy_ms + a.overhead_ms)
    assert predict_step_ms(after, opts) > predict_step_ms(before, opts) + min(s.overhead_ms for s in after.stages)
    plan = build_plan(profile, costs, model.cluster, STAGES, after, opts, "optimal")
    plain = build_plan(profile, plain_costs, model.cluster, STAGES, before, opts, "optimal")
    assert [s.overhead_ms for s in plan.stages] == pytest.approx([s.overhead_ms for s in after.stages])
    assert simulate(plan).step_ms > simulate(plain).step_ms + min(s.overhead_ms for s in plan.stages) * 0.9


def test_measured_overlap_slowdown_stretches_every_all_reduce_and_survives_a_round_trip(tmp_path):
    from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, load_calibration, save_calibration
    fit = LinkFit(1e-4, 1e-8)
    plain = Calibration(4, 4, "gloo", "cpu", "", 1e-10, fit, {"ring": fit, "butterfly": fit})
    slowed = dataclasses.replace(plain, interference_s_per_byte=3e-9, overlap_slowdown=1.5)
    assert load_calibration(save_calibration(slowed, tmp_path / "cal.json")) == slowed
    cluster = flat_cluster(4, gbps=1.0)
    base, stretched = CostModel(cluster, plain), CostModel(cluster, slowed)
    for algorithm in ("ring", "butterfly", "native"):
        assert stretched.allreduce_seconds(algorithm, 8e6, range(4)) == pytest.approx(
            1.5 * base.allreduce_seconds(algorithm, 8e6, range(4)))
    assert stretched.p2p_seconds(8e6, 0) == base.p2p_seconds(8e6, 0)      # transfers are priced as measured
    assert CostModel(cluster).overlap_slowdown == 1.0 and CostModel(cluster).interference_s_per_byte == 0.0


def _dp_prediction(layers, interference: float) -> tuple[float, object]:
    """Data parallelism on 2 ranks (one stage) of ``layers``: the prediction and the stage's figures."""
    costs = model_costs(make_profile(layers))
    model = CostModel(flat_cluster(2, gbps=1.0))
    model.interference_s_per_byte = interference
    opts = Options(get_schedule("1f1b"), 2, "sgd")
    ev = evaluate(costs, model, (StageSpec(0, len(layers) + 1, (0, 1)),), opts)
    return predict_step_ms(ev, opts), ev.stages[0]


def test_compute_lost_beside_an_all_reduce_counts_only_where_it_ran_beside_compute():
    """An all-reduce that runs after the backward (exposed) takes no compute from it: the prediction does
    not add the ring's interference to it; one hidden behind the backward stretches the backward by it."""
    exposed_layers = [(1.0, 1.0, 1000, 8_000_000), (1.0, 50.0, 1000, 0)]     # weights ready when the backward ends
    plain, _ = _dp_prediction(exposed_layers, 0.0)
    lossy, st = _dp_prediction(exposed_layers, 5e-9)
    assert st.ring_ms == pytest.approx(1e-9 * 5e3 * 8_000_000) and st.sync.exposed_ms == pytest.approx(st.sync.busy_ms)
    assert lossy == pytest.approx(plain)
    hidden_layers = [(1.0, 400.0, 1000, 0), (1.0, 1.0, 1000, 8_000_000)]     # weights ready first, 400 ms to hide in
    plain, _ = _dp_prediction(hidden_layers, 0.0)
    lossy, st = _dp_prediction(hidden_layers, 5e-9)
    assert st.sync.exposed_ms == 0.0 and st.overlapped_ring_ms == pytest.approx(st.ring_ms)
    assert lossy == pytest.approx(plain + st.ring_ms)


def _dp_plan(layers, interference: float, micro_batches: int = 2):
    """``_dp_prediction``'s stage as a plan."""
    profile = make_profile(layers)
    costs = model_costs(profile)
    model = CostModel(flat_cluster(2, gbps=1.0))
    model.interference_s_per_byte = interference
    opts = Options(get_schedule("1f1b"), micro_batches, "sgd")
    stages = (StageSpec(0, len(layers) + 1, (0, 1)),)
    return build_plan(profile, costs, model.cluster, stages, evaluate(costs, model, stages, opts), opts, "optimal",
                      model)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_the_simulator_counts_the_compute_lost_beside_an_all_reduce_as_the_prediction_does(micro_batches):
    """An exposed all-reduce takes no compute from the backward; a hidden one's loss stretches the backward
    its exposed part is measured from, so the step pays the larger of the two: simulated as predicted (the
    simulator spread the whole loss over the backwards before, on top of the exposed sync)."""
    exposed = [(1.0, 1.0, 1000, 8_000_000), (1.0, 50.0, 1000, 0)]          # ready when the backward ends
    half_hidden = [(1.0, 100.0, 1000, 8_000_000), (1.0, 100.0, 1000, 8_000_000)]   # 1 of 2 all-reduces hidden
    for layers, interference in ((exposed, 5e-9), (half_hidden, 5e-9), (half_hidden, 2e-8)):
        plain, lossy = _dp_plan(layers, 0.0, micro_batches), _dp_plan(layers, interference, micro_batches)
        st = lossy.stages[0]
        assert st.ring_ms > 0 and lossy.predicted_step_ms < plain.predicted_step_ms + st.ring_ms
        assert simulate(plain).step_ms == pytest.approx(plain.predicted_step_ms)
        assert simulate(lossy).step_ms == pytest.approx(lossy.predicted_step_ms)


def test_a_plan_without_the_ring_figures_still_reads_and_spreads_the_whole_overhead():
    lossy = _dp_plan([(1.0, 1.0, 1000, 8_000_000), (1.0, 50.0, 1000, 0)], 5e-9)
    old = lossy.to_dict()
    for s in old["stages"]:
        del s["ring_ms"], s["overlapped_ring_ms"]
    read = Plan.from_dict(old)
    assert read.stages[0].ring_ms == 0.0 and read.stages[0].overhead_ms == lossy.stages[0].overhead_ms
    plain = _dp_plan([(1.0, 1.0, 1000, 8_000_000), (1.0, 50.0, 1000, 0)], 0.0)
    assert simulate(read).step_ms == pytest.approx(simulate(plain).step_ms + read.stages[0].overhead_ms)
