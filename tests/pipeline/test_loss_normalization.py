"""The user's own loss on any model, and token-weighted loss (``--loss-normalization tokens``),
against plain single-process loops written here (no hybridpipe helper in them).

Hugging Face models trained through the pipeline in one process (a thread per rank) on token
batches padded to different lengths with -100 labels:

* ``tokens``: every step equals ONE full-batch step of one process (all the step's samples padded
  together, the loss averaged over all their valid tokens), on 4 stages and 2 stages x 2 replicas,
  for models computing their own loss (GPT-2 causal LM, DistilBERT masked LM) and for the user's
  (loss_sum, count) losses;
* ``micro-batch`` (the default): unchanged, the mean of the micro-batches' mean losses (gradient
  accumulation), which is NOT the full-batch step here (the test shows how far apart).
"""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, max_diff, train_pipeline
from tests.pipeline.loss_models import Ragged, masked_tag_loss, smoothed_lm_loss

pytest.importorskip("transformers")

M, B, STEPS, LR = 4, 2, 3, 0.05
LAYOUTS = {"4": [1, 1, 1, 1], "2x2": [2, 2]}
MODELS = {   # factory -> (dataset kind, cuts of 4 stages, cut of 2, the single-process loss: None = the model's own)
    "gpt2_own": ("lm", [0, 3, 4], [3], None),
    "distilbert_mlm": ("mlm", [0, 1, 4], [1], None),
    "gpt2_smoothed": ("lm-pairs", [0, 3, 4], [3], smoothed_lm_loss),
    "distilbert_tagger": ("tags-pairs", [0, 1, 2], [1], masked_tag_loss),
}


def spec_of(name: str, pair: bool = False) -> str:
    return f"tests.pipeline.loss_models:{name}" + ("[pair=true]" if pair else "")


def plan_for(name: str, layout: str, schedule: str = "1f1b", pair: bool = False):
    _, four, two, _ = MODELS[name]
    return make_plan(spec_of(name, pair), four if layout == "4" else two, LAYOUTS[layout], schedule=schedule,
                     micro_batches=M, batch_size=B, shared_capture=True)


def single_process(name: str, *, full_batch: bool, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the factory's model from seed 0, SGD (lr 0.05, momentum 0.5) as the pipeline's;
    each step either ONE forward/backward on all its M x B samples padded together (full_batch), or
    M micro-batches each contributing its own mean loss / M (gradient accumulation)."""
    import tests.pipeline.loss_models as factories

    kind, _, _, loss_fn = MODELS[name]
    data = Ragged(kind)
    torch.manual_seed(0)
    model = getattr(factories, name)()[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)

    def loss_of(samples: list) -> torch.Tensor:
        batch = Ragged.collate_fn(samples)
        if loss_fn is None:
            return model(**batch, use_cache=False).loss if "gpt2" in name else model(**batch).loss
        inputs, target = batch
        return loss_fn(model(**inputs), target)

    for k in range(steps):
        samples = [data[(k * M * B + i) % len(data)] for i in range(M * B)]
        opt.zero_grad()
        if full_batch:
            loss_of(samples).backward()
        else:
            for m in range(M):
                (loss_of(samples[m * B:(m + 1) * B]) / M).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# the rest: make test-slow (a user loss pair under tokens in real processes: tests/runtime/test_user_loss_launch.py)
FAST = {("gpt2_own", "2x2"), ("distilbert_mlm", "4")}


def cases():
    for name in MODELS:
        for layout in LAYOUTS:
            marks = () if (name, layout) in FAST else (pytest.mark.slow,)
            yield pytest.param(name, layout, marks=marks, id=f"{name}-{layout}")


@pytest.mark.parametrize("name,layout", list(cases()))
def test_tokens_equals_one_full_batch_step(name, layout):
    pair = MODELS[name][3] is not None          # the user's loss in its (loss_sum, count) form
    plan = plan_for(name, layout, pair=pair)
    ours, losses = train_pipeline(plan, STEPS, lr=LR, dataset=Ragged(MODELS[name][0]), shared_capture=True,
                                  tokens=True)
    full = single_process(name, full_batch=True)
    assert max_diff(ours, full) <= 1e-6
    # ... which micro-batch means do not give: the valid tokens differ from micro-batch to micro-batch
    assert max_diff(single_process(name, full_batch=False), full) > 1e-4
    assert all(len(v) == M for v in losses.values())


@pytest.mark.parametrize("name,layout,pair", [
    ("gpt2_own", "4", False), ("distilbert_tagger", "4", True),
    pytest.param("gpt2_smoothed", "4", False, marks=pytest.mark.slow),
    pytest.param("distilbert_mlm", "2x2", False, marks=pytest.mark.slow),
    pytest.param("distilbert_tagger", "2x2", False, marks=pytest.mark.slow),
    pytest.param("gpt2_smoothed", "2x2", True, marks=pytest.mark.slow)])
def test_micro_batch_normalization_is_the_mean_of_micro_batch_means(name, layout, pair):
    """The default is unchanged: the loss function's mean (a (loss_sum, count) pair: sum / count),
    or the model's own, per micro-batch, / M. The user's loss on a Hugging Face model's output."""
    plan = plan_for(name, layout, pair=pair)
    ours, _ = train_pipeline(plan, STEPS, lr=LR, dataset=Ragged(MODELS[name][0]), shared_capture=True)
    assert max_diff(ours, single_process(name, full_batch=False)) <= 1e-6


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", pytest.param("gpipe", marks=pytest.mark.slow),
                                      pytest.param("interleaved-1f1b", marks=pytest.mark.slow)])
def test_tokens_under_other_flushed_schedules(schedule):
    """zb-h1 splits the backward (weight gradients later): the division still comes once, at the
    step; zbv and interleaved-1f1b (2 ranks x 2 model chunks) hand the label counts from chunk to
    chunk inside a rank too."""
    virtual = schedule in ("zbv", "interleaved-1f1b")
    plan = make_plan(spec_of("gpt2_own"), [0, 3, 4], [1, 1] if virtual else [1, 1, 1, 1], schedule=schedule,
                     micro_batches=M, batch_size=B, shared_capture=True, virtual_stages=2 if virtual else 1)
    ours, _ = train_pipeline(plan, STEPS, lr=LR, dataset=Ragged("lm"), shared_capture=True, tokens=True)
    assert max_diff(ours, single_process("gpt2_own", full_batch=True)) <= 1e-6


def test_tokens_is_refused_under_pipedream():
    plan = make_plan("tests.profiles.user_models:tiny", [1], [1, 1], schedule="pipedream", micro_batches=2,
                     batch_size=4)
    with pytest.raises(UserError, match="pipedream updates each stage after each micro-batch"):
        train_pipeline(plan, 1, tokens=True)


def test_the_steps_loss_is_the_full_batch_loss():
    """StepResult.mean_loss under tokens = the full batch's token-mean loss, on every rank."""
    plan = plan_for("gpt2_own", "2x2")
    results: dict = {}
    train_pipeline(plan, 1, lr=LR, dataset=Ragged("lm"), shared_capture=True, tokens=True, step_results=results)
    import tests.pipeline.loss_models as factories

    torch.manual_seed(0)
    model = factories.gpt2_own()[0]
    data = Ragged("lm")
    with torch.no_grad():
        want = float(model(**Ragged.collate_fn([data[i] for i in range(M * B)]), use_cache=False).loss)
    got = {rank: res[0].mean_loss for rank, res in results.items()}
    assert all(abs(v - want) <= 1e-6 for v in got.values()), (got, want)


def test_tokens_needs_the_count():
    """A mean-returning loss function cannot be token-weighted: one line saying what to return."""
    plan = make_plan("tests.profiles.user_models:tiny", [1], [1, 1], micro_batches=2, batch_size=4)
    with pytest.raises(UserError, match=r"must return \(loss_sum, count\)"):
        train_pipeline(plan, 1, tokens=True)


def test_user_loss_specs_take_any_input_and_target():
    spec = resolve_model(spec_of("distilbert_tagger"))
    x, y = spec.example_input(3), spec.example_target(3)
    assert set(x) == {"input_ids", "attention_mask"} and set(y) == {"tags", "mask"}
    assert y["tags"].shape == x["input_ids"].shape and y["mask"].dtype == torch.float32
