"""hybridpipe.Trainer (the Python API) on 4 real rank processes (gloo) against a plain PyTorch loop.

A torch scheduler (linear warm-up then cosine, SequentialLR), SGD with momentum and weight
decay, and clipping by the global norm at a norm the gradients exceed: after 5 steps the merged
weights equal single-process training of the unsplit model with ``clip_grad_norm_`` and the same
scheduler (<= 1e-5); every rank gets the reference's loss; an evaluation step in between changes
no weight, optimizer or scheduler state and gives the unsplit model's evaluation loss; resuming
from the step-3 checkpoint continues bit-identically (scheduler restored).
"""

from __future__ import annotations

import os

import pytest
import torch

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.allocator import chosen_elsewhere
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import data_for, final_weights, max_diff
from tests.runtime.rank_procs import Job
from tests.runtime.trainer_ranks import SEED, STEPS, sgd_wd, warm_cosine

RANKS = __import__("pathlib").Path(__file__).with_name("trainer_ranks.py")
CLIP = 0.1
EVAL_AT = 2


def reference(plan, clip: float) -> tuple[dict, list[float], list[float], float]:
    """Plain single-process training: weights, losses, pre-clip norms, eval loss after EVAL_AT steps."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = sgd_wd(model.parameters())
    sched = warm_cosine(opt)
    data = data_for(plan, STEPS, SEED)
    losses, norms, eval_loss = [], [], float("nan")
    for k in range(STEPS):
        opt.zero_grad()
        loss = model_loss(spec, model, *data.global_batch(k))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if k + 1 == EVAL_AT:
            model.eval()
            with torch.no_grad():
                eval_loss = float(model_loss(spec, model, *data.global_batch(0)))
            model.train()
    return model.state_dict(), losses, norms, eval_loss


def run(plan, calls: list, timeout: float = 240) -> list[list]:
    """One job of the plan's world size running ``calls`` of trainer_ranks.py in turn on every rank
    (trainer_ranks.in_turn: one start-up for all); each rank's list of values."""
    with Job(RANKS, "in_turn", plan.world_size, (calls,)) as job:
        results = job.wait(timeout=timeout)
    assert all(r.returncode == 0 for r in results), results
    return [r.value for r in results]


@pytest.mark.parametrize("model,replicas,cuts", [
    ("mlp", [2, 2], [3]),
    pytest.param("mlp", [1, 1, 1, 1], [1, 3, 5], marks=pytest.mark.slow),
    pytest.param("gpt2", [2, 2], None, marks=pytest.mark.slow),     # the tied embedding cut apart: counted once
], ids=["2x2", "4-stages", "gpt2-tied-2x2"])
def test_trainer_matches_plain_pytorch_loop_with_schedule_clipping_and_weight_decay(tmp_path, model, replicas, cuts):
    if model == "gpt2":
        pytest.importorskip("transformers")
        from tests.pipeline.hf_models import BY_NAME
        model, cuts = BY_NAME["gpt2"].spec, BY_NAME["gpt2"].two
    plan = make_plan(model, cuts, replicas, schedule="1f1b", micro_batches=4, batch_size=2 if replicas == [2, 2]
                     and cuts != [3] else 4, shared_capture=True)
    assert model == "mlp" or [t.stages for t in plan.tied] == [(0, 1)]
    weights, losses, norms, eval_loss = reference(plan, CLIP)
    assert min(norms) > 2 * CLIP                               # the clipping really acts
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    args = [str(path), str(tmp_path), CLIP, EVAL_AT]
    ranks = run(plan, [["train_api", [*args, False]], ["train_api", [*args, True]]])   # train; resume from step 3
    values, resumed = [v[0] for v in ranks], [v[1] for v in ranks]
    assert max_diff(final_weights(tmp_path / "end", STEPS), weights) <= 1e-5
    for v in values:                                           # every rank: the loss, the norm
        assert [v["losses"][str(k)] for k in range(STEPS)] == pytest.approx(losses, abs=1e-5)
        assert [v["norms"][str(k)] for k in range(STEPS)] == pytest.approx(norms, rel=1e-5)
        assert v["eval"] == pytest.approx([eval_loss] * 2, abs=1e-5) and not v["eval_changed"]
        assert v["allocator"] == ("kept" if (set_by := chosen_elsewhere(os.environ)) is None else f"{set_by} set")
    first = values[0]["lrs"]
    end, again = final_weights(tmp_path / "end", STEPS), final_weights(tmp_path / "resumed", STEPS)
    assert all(torch.equal(end[k], again[k]) for k in end)     # bit-identical continuation
    assert all(v["lrs"] == {k: first[k] for k in v["lrs"]} for v in resumed)   # the scheduler restored


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One job of 4 ranks (2 stages x 2 replicas of a small GPT) for the precision tests below:
    8 Adam steps in fp32, bf16 and fp16; 10 fp16 steps from a loss scale of 2**24 saved after 5,
    then resumed from there. Each: every rank's value."""
    tmp = tmp_path_factory.mktemp("gpt-trainer")
    plan = make_plan("gpt[layers=2,width=32,heads=2,seq=16,vocab=64]", [2], [2, 2], schedule="1f1b",
                     micro_batches=4, batch_size=4)
    path = str(save_plan(plan, tmp / "plan.json"))
    names = ["fp32", "bf16", "fp16", "overflow", "overflow-resumed"]
    calls = [["train_precision", [path, p, 8]] for p in names[:3]]
    calls += [["train_fp16", [path, str(tmp), resume]] for resume in (False, True)]
    ranks = run(plan, calls, timeout=300)
    return {name: [v[i] for v in ranks] for i, name in enumerate(names)}


def test_bf16_and_fp16_follow_fp32_and_send_what_autocast_computed(gpt_runs):
    """bf16 and fp16 autocast on CPU: the loss curve stays within 0.01 nats of fp32's over 8 Adam steps
    (measured bf16: < 1e-3 while the loss falls 4.25 -> 1.55), weights stay float32, and activations
    cross in the dtype the stage computed them in: this GPT's cut carries its residual stream, float32
    under autocast as in the unsplit model, so exactly as many bytes as fp32 (1048576)."""
    runs = {p: gpt_runs[p] for p in ("fp32", "bf16", "fp16")}
    fp32 = runs["fp32"][0]["losses"]
    assert fp32[0] - fp32[-1] > 1.0                                     # it learns
    sent = {p: sum(v["bytes"] for v in runs[p]) for p in runs}
    for half in ("bf16", "fp16"):
        losses = runs[half][0]["losses"]
        assert max(abs(a - b) for a, b in zip(fp32, losses, strict=True)) < 0.01, (fp32, half, losses)
        assert all(v["param_dtypes"] == ["torch.float32"] for v in runs[half])
        assert sent["fp32"] > 0 and sent[half] == sent["fp32"], sent


def test_fp16_overflow_skips_the_step_on_every_rank_and_resume_restores_the_scale(gpt_runs):
    """A loss scale too large for float16 (activation gradients, or the replicas' fp16 all-reduce,
    overflow): every rank skips those steps (no weight changes) and halves the scale, the others
    train; resuming from step 5 continues bit for bit
    with the scaler's state restored."""
    values = {False: gpt_runs["overflow"], True: gpt_runs["overflow-resumed"]}
    first = values[False]
    scales = first[0]["scales"]
    assert all(v["scales"] == scales for v in first)                 # every rank agrees
    changed = first[0]["changed"]
    assert 0 < changed.count(False) < 10 and changed[0] is False, first[0]    # 2**24 overflows at once
    assert all(v["changed"] == changed for v in first if v["has_params"])
    scale = 2.0**24
    for k in range(10):                   # a skipped step (no weight changed anywhere) halves the scale
        scale = scale if changed[k] else scale / 2
        assert scales[k] == scale, (k, scales, changed)
    for a, b in zip(first, values[True], strict=True):
        assert b["scales"] == a["scales"][5:] and b["digest"] == a["digest"]     # bit-identical continuation
