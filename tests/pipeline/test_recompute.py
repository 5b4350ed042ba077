"""Activation recomputation: a stage that keeps only its inputs and reruns its forward in the
backward trains exactly as one that keeps everything, under every schedule."""

from __future__ import annotations

import dataclasses

import pytest

from tests.pipeline.harness import make_plan, max_diff, train_pipeline, train_reference
from tests.pipeline.test_engine import CASES, STEPS

TOL = 1e-5


def recomputing(case: str, schedule: str, every: bool = True):
    model, cuts, reps, M, B, granularity = CASES[case]
    plan = make_plan(model, cuts, reps, schedule=schedule, micro_batches=M, batch_size=B, granularity=granularity)
    stages = tuple(dataclasses.replace(s, recompute=every or s.index % 2 == 1) for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("case", ["mlp", "gpt", "resnet-small"])
def test_recomputation_equals_single_process_sgd(case, schedule):
    plan = recomputing(case, schedule, every=case != "gpt")
    ours, _ = train_pipeline(plan, STEPS)
    assert max_diff(ours, train_reference(plan, STEPS)) <= TOL


def test_recomputation_under_pipedream_equals_keeping_the_activations():
    plan = recomputing("mlp-4-stages", "pipedream")
    plain = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=False) for s in plan.stages))
    ours, _ = train_pipeline(plan, STEPS)
    theirs, _ = train_pipeline(plain, STEPS)
    assert max_diff(ours, theirs) <= TOL
