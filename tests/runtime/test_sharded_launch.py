"""Sharded replicas through launch under torchrun-like processes (gloo): stage 0's replicas shard
gradients (ZeRO-2), stage 1's the optimizer state (ZeRO-1), or both stages the weights (ZeRO-3, one
resharding after each forward, one keeping them over the step); AdamW with global-norm clipping equals
a plain single-process loop, and the checkpoint holds the whole (gathered) weights and optimizer state
in the plan-independent format, equal to the plain loop's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import stage_file, step_dir
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import data_for, final_weights, launch, max_diff

STEPS, LR, WD, SEED, CLIP = 3, 0.01, 0.1, 5, 0.05


def plain_loop(plan) -> tuple[dict[str, torch.Tensor], dict]:
    """The unsplit model in one process: each micro-batch's mean loss / M, clipped by the global
    norm, torch's AdamW; its weights and its optimizer state by parameter name."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    data = data_for(plan, STEPS, SEED)
    for k in range(STEPS):
        opt.zero_grad()
        for m in range(plan.micro_batches):
            (model_loss(spec, model, *data.batch(k, m)) / plan.micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return model.state_dict(), {names[id(p)]: s for p, s in opt.state.items()}


@pytest.mark.parametrize("first,second", [
    (("gradients", True), ("optimizer", True)),
    pytest.param(("parameters", True), ("parameters", False), marks=pytest.mark.slow),
])
def test_launch_sharded_stages_equal_a_plain_loop_and_save_the_whole_state(tmp_path, first, second):
    plan = make_plan("mlp", [3], [2, 2], schedule="1f1b", micro_batches=4, batch_size=4)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=level, reshard_after_forward=reshard)
                                                  for s, (level, reshard) in zip(plan.stages, (first, second),
                                                                                 strict=True)))
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--optimizer", "adamw",
                   "--lr", str(LR), "--weight-decay", str(WD), "--seed", str(SEED), "--clip-grad-norm", str(CLIP),
                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
                   "--timeout", "60", "--no-progress", "--no-trace"], plan.world_size, timeout=150)
    assert all(d.returncode == 0 for d in done), done
    weights, state = plain_loop(plan)
    assert max_diff(final_weights(tmp_path / "ckpt", STEPS), weights) <= 1e-5
    saved = {}
    for s in plan.stages:
        saved.update(torch.load(step_dir(tmp_path / "ckpt", STEPS) / stage_file(s.index))["optimizer"]["state"])
    assert set(saved) == set(state)
    for name, st in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert saved[name][key].shape == st[key].shape
            assert float((saved[name][key] - st[key]).abs().max()) <= 1e-5, (name, key)
        assert float(saved[name]["step"]) == float(st["step"])
