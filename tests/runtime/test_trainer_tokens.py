"""Trainer(loss_normalization="tokens") on 4 real rank processes (gloo, 2 stages x 2 replicas)
against a plain PyTorch loop: GPT-2 computing its own loss from -100 labels, micro-batches padded
to different lengths (the label counts travel from the first stage to the last with the
activations), clipped by the global norm: every rank reports the full-batch loss, the norm before
clipping and the evaluation loss of one process, and the weights end within 1e-6 of it."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.partitioner.plan import save_plan
from tests.pipeline.harness import make_plan
from tests.pipeline.loss_models import Ragged, gpt2_own
from tests.runtime.jobs import final_weights, max_diff
from tests.runtime.rank_procs import Job
from tests.runtime.token_ranks import LR, MOMENTUM, STEPS

pytest.importorskip("transformers")

RANKS = __import__("pathlib").Path(__file__).with_name("token_ranks.py")
CLIP = 0.5


def one_process() -> tuple[dict, list[float], list[float], float]:
    """Plain PyTorch: each step one batch of all its samples (padded together), clip, SGD."""
    torch.manual_seed(0)
    model = gpt2_own()[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = Ragged("lm")
    losses, norms = [], []
    for k in range(STEPS):
        samples = [data[i] for i in range(k * 8, k * 8 + 8)]
        opt.zero_grad()
        loss = model(**Ragged.collate_fn(samples), use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        evaluated = float(model(**Ragged.collate_fn([data[i] for i in range(8)]), use_cache=False).loss)
    return model.state_dict(), losses, norms, evaluated


@pytest.mark.slow
def test_trainer_tokens_with_own_loss_clipping_and_eval_equals_one_process(tmp_path):
    plan = make_plan("tests.pipeline.loss_models:gpt2_own", [3], [2, 2], micro_batches=4, batch_size=2,
                     shared_capture=True)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    with Job(RANKS, "train_tokens", plan.world_size, (str(path), str(tmp_path / "ckpt"), CLIP, "fp32")) as job:
        results = job.wait(timeout=300)
    assert all(r.returncode == 0 for r in results), results
    weights, losses, norms, evaluated = one_process()
    assert min(norms) > CLIP                                    # the clipping acts
    for r in results:
        assert r.value["losses"] == pytest.approx(losses, abs=1e-6)
        assert r.value["norms"] == pytest.approx(norms, rel=1e-6)
        assert r.value["eval"] == pytest.approx(evaluated, abs=1e-6)
    assert max_diff(final_weights(tmp_path / "ckpt", STEPS), weights) <= 1e-6


@pytest.mark.slow
def test_fp16_loss_scaling_under_tokens_follows_fp32(tmp_path):
    """fp16's loss scale multiplies the summed loss like a mean one and is divided out after the
    1/tokens factor: the losses stay within 0.01 nats of fp32's, no step overflows at 2**16."""
    plan = make_plan("tests.pipeline.loss_models:tiny_tagger", [1], [2, 2], micro_batches=4, batch_size=4)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    runs = {}
    for precision in ("fp32", "fp16"):
        with Job(RANKS, "train_precision_tokens", plan.world_size, (str(path), precision, 6)) as job:
            results = job.wait(timeout=180)
        assert all(r.returncode == 0 for r in results), results
        runs[precision] = results[0].value
    fp32, fp16 = runs["fp32"]["losses"], runs["fp16"]["losses"]
    assert fp32[0] - fp32[-1] > 0.1                                       # it learns
    assert max(abs(a - b) for a, b in zip(fp32, fp16, strict=True)) < 0.01, (fp32, fp16)
    assert runs["fp16"]["scales"] == [2.0**16] * 6


@pytest.mark.slow
def test_a_resumed_token_weighted_run_continues_bit_for_bit(tmp_path):
    """Padded micro-batches (the step's token count varies): saved after one step and resumed, the
    run ends bit-identical to the uninterrupted one (the backward's divisor is fixed for the run)."""
    plan = make_plan("tests.pipeline.loss_models:gpt2_own", [3], [2, 2], micro_batches=4, batch_size=2,
                     shared_capture=True)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    with Job(RANKS, "resume_tokens", plan.world_size, (str(path), str(tmp_path))) as job:
        results = job.wait(timeout=300)
    assert all(r.returncode == 0 for r in results), results
    end, again = final_weights(tmp_path / "end", STEPS), final_weights(tmp_path / "resumed", STEPS)
    assert all(torch.equal(end[k], again[k]) for k in end)
