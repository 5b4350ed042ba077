"""Audit of sharded replicas (ZeRO-1/2/3) on 2 stages x 2 replicas, real rank processes (gloo),
each against a plain single-process PyTorch loop written here (weights, buffers, losses):

* fp16 with the loss scale forced to overflow (ZeRO-2, ZeRO-3): the overflowing steps are skipped
  on every rank as torch.amp.GradScaler skips them (no update, no AdamW step count, the owned
  gradient shards dropped, the scale halved) and the steps after them equal the plain loop's.
* Clipping by the global norm with GPT-2's tied embedding / LM head cut over the 2 stages (ZeRO-1,
  2, 3): each step's norm is torch.nn.utils.clip_grad_norm_ over the unsplit model (the tied weight
  counted once).
* Evaluation between training steps at ZeRO-3 (weights resharded after each forward or kept), on a
  model with batch norm: the evaluation losses are the plain model's in eval mode, and training
  after an evaluation continues equal.

All are multi-process: make test-slow.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hybridpipe.partitioner.plan import Plan, save_plan
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, model_loss
from tests.pipeline.hf_models import BY_NAME, GPT2
from tests.runtime.jobs import data_for, final_weights, max_diff
from tests.runtime.rank_procs import Job
from tests.runtime.sharded_audit_ranks import EVAL_SEED, LR, SEED, STEPS, WD

RANKS = Path(__file__).with_name("sharded_audit_ranks.py")
M = 4


def run(plan: Plan, tmp_path: Path, calls: list, timeout: float = 120) -> list[list]:
    path = str(save_plan(plan, tmp_path / "plan.json"))
    calls = [[name, [path, str(tmp_path), *args]] for name, args in calls]
    with Job(RANKS, "in_turn", plan.world_size, (calls,)) as job:
        results = job.wait(timeout=timeout)
    assert all(r.returncode == 0 for r in results), results
    return [r.value for r in results]


def sharded(plan: Plan, level: str, reshard: bool = True) -> Plan:
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=level, reshard_after_forward=reshard)
                                                  for s in plan.stages))


def build(plan: Plan) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    return spec, model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def fp16_loop(plan: Plan, init_scale: float, force_after: int, forced: float) -> tuple[dict, list, list, list]:
    """The unsplit model under fp16 autocast with torch's GradScaler, each micro-batch's mean loss / M
    accumulated; after step ``force_after`` the scale is set to ``forced``: (state_dict, losses,
    scales after each step, which steps were skipped)."""
    spec, model, opt = build(plan)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    data = data_for(plan, STEPS, SEED)
    losses, scales, skipped = [], [], []
    for k in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model_loss(spec, model, *data.batch(k, m))
            total += float(loss.detach()) / M
            scaler.scale(loss / M).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update(forced if k == force_after else None)
        skipped.append(scaler.get_scale() < before and k != force_after)
        losses.append(total)
        scales.append(scaler.get_scale())
    return model.state_dict(), losses, scales, skipped


# the plain loop takes steps 0, 1, 3 and 5 and skips step 2 (the scale forced to 2^20 after step 1)
# and step 4 (2^19 overflows it)
INIT, FORCE_AFTER, FORCED = 2.0**19, 1, 2.0**20


@pytest.mark.slow
@pytest.mark.parametrize("level", ["none", "gradients", "parameters"])
def test_fp16_overflow_on_sharded_stages_is_skipped_as_grad_scaler_skips_it(tmp_path, level):
    plan = sharded(make_plan("mlp", [3], [2, 2], schedule="1f1b", micro_batches=M, batch_size=2), level)
    weights, losses, scales, skipped = fp16_loop(plan, INIT, FORCE_AFTER, FORCED)
    print("plain", skipped, scales)
    assert skipped == [False, False, True, False, True, False]
    ranks = run(plan, tmp_path, [["fp16_forced", [INIT, FORCE_AFTER, FORCED]]])
    for (value,) in ranks:
        assert value["scales"] == scales
        assert value["skipped"] == sum(skipped)
        assert value["losses"] == pytest.approx(losses, abs=1e-4)
    diff = max_diff(final_weights(tmp_path / "fp16", STEPS), weights)
    print("diff", diff)
    assert diff <= 1e-5
