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
  after an evaluation continues equal (SGD with momentum: under AdamW, resnet-small's replicated
  run already ends 2e-3 from one process, gradients that are rounding noise moved by their sign).

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
from tests.runtime.sharded_audit_ranks import EVAL_SEED, OPTIMIZERS, SEED, STEPS, adamw, sgd

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


def build(plan: Plan, optimizer=adamw) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    return spec, model, optimizer(list(model.parameters()))


def fp16_loop(plan: Plan, init_scale: float, force_after: int, forced: float,
              optimizer=adamw) -> tuple[dict, list, list, list]:
    """The unsplit model under fp16 autocast with torch's GradScaler, each micro-batch's mean loss / M
    accumulated; after step ``force_after`` the scale is set to ``forced``: (state_dict, losses,
    scales after each step, which steps were skipped)."""
    spec, model, opt = build(plan, optimizer)
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


# the plain loops take steps 0, 1, 3 and 5 and skip step 2 (the scale forced to 2^20 after step 1)
# and step 4 (half of that overflows it); resnet-small (batch norm: its running statistics move on
# a skipped step too, the forward ran) with SGD and momentum
FORCE_AFTER, FORCED = 1, 2.0**20
FP16 = {"mlp": ([3], "adamw", 2.0**19), "resnet-small": ([4], "sgd", 2.0**18)}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FP16))
@pytest.mark.parametrize("level", ["none", "gradients", "parameters"])
def test_fp16_overflow_on_sharded_stages_is_skipped_as_grad_scaler_skips_it(tmp_path, level, model):
    cuts, optimizer, init = FP16[model]
    plan = sharded(make_plan(model, cuts, [2, 2], schedule="1f1b", micro_batches=M, batch_size=2), level)
    weights, losses, scales, skipped = fp16_loop(plan, init, FORCE_AFTER, FORCED, OPTIMIZERS[optimizer])
    assert skipped == [False, False, True, False, True, False]
    ranks = run(plan, tmp_path, [["fp16_forced", [optimizer, init, FORCE_AFTER, FORCED]]])
    for (value,) in ranks:
        assert value["scales"] == scales
        assert value["skipped"] == sum(skipped)
        assert value["losses"] == pytest.approx(losses, abs=1e-4)
    got = final_weights(tmp_path / "fp16", STEPS)
    diff = max_diff(got, weights)                # weights and every buffer
    print("diff", diff, sorted(((float((got[k].double() - weights[k].double()).abs().max()), k) for k in got),
                               reverse=True)[:3])
    assert diff <= 1e-5


def accumulate(spec, model: torch.nn.Module, data, k: int) -> float:
    """Step ``k``'s gradients: each micro-batch's mean loss / M backpropagated; their sum."""
    total = 0.0
    for m in range(M):
        loss = model_loss(spec, model, *data.batch(k, m)) / M
        loss.backward()
        total += float(loss.detach())
    return total


def clipped_loop(plan: Plan, clip: float) -> tuple[dict, list, list]:
    """The unsplit model, each micro-batch's mean loss / M accumulated, clipped to ``clip`` by
    torch's clip_grad_norm_ over its parameters (a tied weight is one parameter): (state_dict,
    losses, norms)."""
    spec, model, opt = build(plan)
    data = data_for(plan, STEPS, SEED)
    losses, norms = [], []
    for k in range(STEPS):
        opt.zero_grad()
        total = accumulate(spec, model, data, k)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(total)
    return model.state_dict(), losses, norms


# The attention's key bias has a gradient of 0 (softmax ignores what every key adds alike): what
# backward leaves there is rounding, ~1e-11, which AdamW (eps 1e-8) turns into updates of ~1e-5 that
# any other order of the same sums moves (measured 2.2e-5 with plain replicas, 2.5e-5 sharded): it is
# bounded apart (1e-4), every other element compared at 1e-5.
CLIP, WIDTH = 0.5, 32


@pytest.mark.slow
@pytest.mark.parametrize("level", ["none", "optimizer", "gradients", "parameters"])
def test_clipping_with_a_tied_weight_across_sharded_stages_is_torchs_norm(tmp_path, level):
    case = BY_NAME["gpt2"]
    plan = make_plan(GPT2, case.two, [2, 2], schedule="1f1b", micro_batches=M, batch_size=2, shared_capture=True)
    plan = sharded(plan, level)
    assert [t.param for t in plan.tied] == [case.tied]          # wte on stage 0, lm_head on stage 1
    weights, losses, norms = clipped_loop(plan, CLIP)
    assert min(norms) > CLIP                                     # the clipping acts on every step
    ranks = run(plan, tmp_path, [["clipped", [CLIP]]])
    for (value,) in ranks:
        assert value["norms"] == pytest.approx(norms, rel=1e-5)
        assert value["losses"] == pytest.approx(losses, abs=1e-5)
    got = final_weights(tmp_path / "clipped", STEPS)
    noise = {k: (got[k] - weights[k])[WIDTH:2 * WIDTH].abs().max() for k in got if k.endswith("attn.c_attn.bias")}
    for k in noise:                 # the key bias: compared below
        got[k], weights[k] = got[k][[*range(WIDTH), *range(2 * WIDTH, 3 * WIDTH)]], \
            weights[k][[*range(WIDTH), *range(2 * WIDTH, 3 * WIDTH)]]
    diff = max_diff(got, weights)
    print("diff", diff, "key bias", noise)
    assert diff <= 1e-5 and len(noise) == 2 and max(noise.values()) <= 1e-4


EVERY = 3


def evaluated_loop(plan: Plan) -> tuple[dict, list, list]:
    """The unsplit model trained with SGD and momentum (sharded_audit_ranks.sgd), each micro-batch's
    mean loss / M accumulated, and evaluated in eval mode without
    gradients on held-out global batch j before step j * EVERY and after the last: each
    evaluation's mean over the micro-batches' mean losses; (state_dict, losses, evaluations)."""
    spec, model, opt = build(plan, sgd)
    data, held = data_for(plan, STEPS, SEED), data_for(plan, STEPS, EVAL_SEED)

    def evaluate(j: int) -> float:
        model.eval()
        with torch.no_grad():
            value = sum(float(model_loss(spec, model, *held.batch(j, m))) for m in range(M)) / M
        model.train()
        return value

    losses, evals = [], []
    for k in range(STEPS):
        if k % EVERY == 0:
            evals.append(evaluate(k // EVERY))
        opt.zero_grad()
        total = accumulate(spec, model, data, k)
        opt.step()
        losses.append(total)
    evals.append(evaluate(STEPS // EVERY))
    return model.state_dict(), losses, evals


@pytest.mark.slow
@pytest.mark.parametrize("level,reshard", [("none", True), ("parameters", True), ("parameters", False)])
def test_evaluation_at_zero3_is_the_plain_models_and_training_continues_equal(tmp_path, level, reshard):
    """resnet-small (batch norm: evaluation reads the running statistics the training steps
    combined across the replicas), the weights sharded and freed after each forward or kept."""
    plan = sharded(make_plan("resnet-small", [4], [2, 2], schedule="1f1b", micro_batches=M, batch_size=2),
                   level, reshard)
    state, losses, evals = evaluated_loop(plan)
    ranks = run(plan, tmp_path, [["evaluated", [EVERY]]])
    for (value,) in ranks:
        assert value["evals"] == pytest.approx(evals, abs=1e-5)
        assert value["losses"] == pytest.approx(losses, abs=1e-5)
    got = final_weights(tmp_path / "evaluated", STEPS)
    assert set(got) == set(state) and any("running_var" in k for k in state)
    for name, value in got.items():             # weights and every buffer
        if value.is_floating_point():
            assert float((value - state[name]).abs().max()) <= 1e-5, name
        else:
            assert torch.equal(value, state[name]), (name, value, state[name])
