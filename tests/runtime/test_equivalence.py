"""Pipelined training through launch.py (real processes, gloo) gives single-process training's weights.

gpipe and 1f1b with a replicated stage: the same weights as plain SGD on the same global
batches (<= 1e-5 after 5 steps). pipedream: the same weights as an independent single-process
model of weight-stashed asynchronous SGD (tests/pipeline/pipedream_reference.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridpipe.partitioner.plan import load_plan, save_plan
from tests.pipeline.harness import make_plan
from tests.pipeline.pipedream_reference import train_pipedream_reference
from tests.runtime.jobs import data_for, final_weights, launch, max_diff, sgd, train_reference

STEPS, LR, MOMENTUM, SEED = 5, 0.05, 0.5, 3


def run_plan(tmp_path, plan, *extra: str, timeout: float = 150.0):
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    ckpt = tmp_path / "ckpt"
    done = launch(["--plan", str(path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--seed", str(SEED), "--checkpoint-dir", str(ckpt), "--run-dir", str(tmp_path / "run"),
                   "--timeout", "60", "--no-progress", *extra], plan.world_size, timeout=timeout)
    assert all(d.returncode == 0 for d in done), done
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all(summary["replicas_identical"].values()), summary["replicas_identical"]
    assert load_plan(tmp_path / "run" / "plan.json") == plan       # what ran, beside what it measured (autotune --runs)
    return final_weights(ckpt, STEPS), summary


def check_sgd_equivalence(tmp_path, model, cuts, replicas, schedule, micro_batches=4, batch_size=4, *extra,
                          granularity="blocks"):
    plan = make_plan(model, cuts, replicas, schedule=schedule, micro_batches=micro_batches, batch_size=batch_size,
                     granularity=granularity)
    weights, summary = run_plan(tmp_path, plan, *extra)
    reference = train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED)
    assert max_diff(weights, reference) <= 1e-5
    assert summary["steps_run"] == STEPS and len(summary["loss"]) == STEPS
    return summary


@pytest.mark.slow
def test_gpipe_replicated_last_stage_matches_single_process(tmp_path):
    """(Default suite: gpipe with a replicated last stage under launch is
    test_launch_training_options.py's 2 x 2 run.)"""
    summary = check_sgd_equivalence(tmp_path, "mlp", [3], [1, 2], "gpipe", 4, 8)
    assert summary["replicas_identical"] == {"1": True}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("model,cuts,replicas,granularity", [
    ("alexnet-small[dropout=0]", [8], [2, 1], "blocks"),
    ("resnet-small[norm=none]", [7], [1, 2], "modules"),                # the shortcut crosses the cut
    ("gpt[layers=2,width=32,heads=2,seq=16,vocab=64]", [4], [2, 1], "modules"),   # the residual crosses the cut
])
def test_zoo_models_match_single_process(tmp_path, schedule, model, cuts, replicas, granularity):
    check_sgd_equivalence(tmp_path, model, cuts, replicas, schedule, 4, 4, granularity=granularity)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-tensor", "sra"])
def test_comm_modes_match_single_process(tmp_path, mode):
    check_sgd_equivalence(tmp_path, "mlp", [3, 6], [1, 2, 1], "1f1b", 4, 4, "--comm-mode", mode)


@pytest.mark.slow
def test_pipedream_matches_weight_stashed_async_sgd(tmp_path):
    plan = make_plan("mlp", [3, 6], [2, 1, 1], schedule="pipedream", micro_batches=4, batch_size=4)
    weights, _ = run_plan(tmp_path, plan)
    reference = train_pipedream_reference(plan, data_for(plan, STEPS, SEED), STEPS, {STEPS - 1}, lr=LR,
                                          make_optimizer=lambda ps, lr: sgd(ps, lr, MOMENTUM), seed=SEED)
    assert max_diff(weights, reference) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native"])
def test_every_allreduce_matches_single_process(tmp_path, algorithm):
    check_sgd_equivalence(tmp_path, "mlp", [3], [3, 1], "1f1b", 6, 4, "--allreduce", algorithm)


def test_zb_h1_with_replicas_and_recomputation_matches_single_process(tmp_path):
    """The weight halves start the replicas' per-layer all-reduce from their gradient hooks: stage 1's
    replicas recompute their activations in the backward, the replicated last stage keeps them (one
    job for both kinds, 5 ranks)."""
    plan = make_plan("mlp", [2, 5], [1, 2, 2], schedule="zb-h1", micro_batches=4, batch_size=4)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=s.index < 2) for s in plan.stages))
    assert [(s.replicas, s.recompute) for s in plan.stages] == [(1, True), (2, True), (2, False)]
    weights, summary = run_plan(tmp_path, plan)
    assert max_diff(weights, train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED)) <= 1e-5
    assert summary["replicas_identical"] == {"1": True, "2": True}
    for stage in ("1", "2"):                                        # the all-reduce ran, started by the hooks
        assert summary["sync"][stage] and all(lv["algorithm"] for lv in summary["sync"][stage])
    assert sorted(m["rank"] for m in summary["memory"]) == [0, 1, 2, 3, 4]
    assert all(m["peak_bytes"] > 0 for m in summary["memory"])
