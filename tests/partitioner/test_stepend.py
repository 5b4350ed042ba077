"""refine/stepend.py: a replicated stage's exposed sync as the runtime's step end allows it, against
hand-computed lanes (the all-reduce's own price is read from the model; the timeline around it is arithmetic)."""

from __future__ import annotations

import pytest

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.refine.stepend import StepEnd, step_end_evaluation
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import Options, StageSpec, evaluate, predict_step_ms
from tests.partitioner.synth import flat_cluster, make_profile

# (fwd ms, bwd ms, activation bytes, param bytes): l1 has no weights and a long forward and backward;
# l2's 12.5 MB all-reduce over 2 ranks at 1 Gbit/s takes ~100 ms
LAYERS = [(80.0, 40.0, 1000, 0), (5.0, 10.0, 1000, 12_500_000)]
OPTS = Options(get_schedule("1f1b"), 4, "sgd")


def _setup(stages):
    costs = model_costs(make_profile(LAYERS))
    model = CostModel(flat_cluster(3, gbps=1.0))
    return costs, stages, evaluate(costs, model, stages, OPTS)


def test_a_replicated_last_stage_hides_its_sync_only_behind_the_drain_not_the_next_fill():
    # stage 0 = x, l1 on rank 0; stage 1 = l2, output on ranks 1, 2 (the loss check is then an all-reduce)
    costs, stages, ev = _setup((StageSpec(0, 1, (0,)), StageSpec(2, 3, (1, 2))))
    s = ev.stages[1].sync.layers[0].predicted_ms          # l2's all-reduce, priced by the model
    assert 40.0 < s < 120.0
    # the lane: l2's gradient is ready at the end of the stage's backward (output's 0.01 ms, then l2's), so its
    # all-reduce runs s ms after the backward; the objective lets it hide behind stage 0's drain and next fill
    # (F + B of l1 = 120 ms): nothing exposed. The runtime's loss check holds every rank until stage 1 enters
    # it, so only stage 0's drain (its backward, 40 ms) hides it: s - 40 exposed.
    assert ev.stages[1].sync.exposed_ms == pytest.approx(0.0)
    after = step_end_evaluation(ev, costs, list(stages), OPTS, StepEnd(barrier=True))
    assert after.stages[1].sync.exposed_ms == pytest.approx(s - 40.0)
    assert after.stages[0] == ev.stages[0]
    assert predict_step_ms(after, OPTS) >= predict_step_ms(ev, OPTS)   # here stage 0's 4 micro-batches bind


def test_without_a_replicated_last_stage_the_fill_still_hides_the_sync():
    # stage 0 = x, l1, l2 on ranks 0, 1; stage 1 = output on rank 2: the check rides on the gradient frames
    costs, stages, ev = _setup((StageSpec(0, 2, (0, 1)), StageSpec(3, 3, (2,))))
    after = step_end_evaluation(ev, costs, list(stages), OPTS, StepEnd(barrier=True))
    assert after.stages[0].sync.exposed_ms == pytest.approx(ev.stages[0].sync.exposed_ms)


def test_finish_waits_every_layer_before_the_step_so_no_sync_hides_behind_the_stages_own_forwards():
    # data parallelism on 2 ranks: l2's all-reduce starts when the backward reaches it (after output's and
    # l2's backward: 10.01 ms), then l1's 40 ms backward runs beside it; it ends 10.01 + s, the backward
    # at 50.01. The objective's lane lets it run on into the next step's forward of l1 (80 ms, no weights),
    # the runtime's finish() waits for it before the optimizer step: s - 40 exposed, not s - 120.
    costs, stages, ev = _setup((StageSpec(0, 3, (0, 1)),))
    s = ev.stages[0].sync.layers[0].predicted_ms
    assert ev.stages[0].sync.exposed_ms == pytest.approx(max(0.0, s - 40.0 - 80.0))
    after = step_end_evaluation(ev, costs, list(stages), OPTS, StepEnd(finish=True))
    assert after.stages[0].sync.exposed_ms == pytest.approx(s - 40.0)
    assert step_end_evaluation(ev, costs, list(stages), OPTS, StepEnd()) is ev
