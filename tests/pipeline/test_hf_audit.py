"""Correctness audit: Hugging Face families and features the other matrices do not reach, each
pipeline (one process, a thread per rank) against a plain one-process loop written here
(:func:`plain_loop`: the unsplit model, micro-batches in order, each one's mean loss / M accumulated,
SGD lr 0.05 momentum 0.5), every weight AND buffer compared after 3 steps (integer buffers exactly).

* padded batches the model must mask: DistilBERT (bidirectional) padded on the right, Llama padded
  on the LEFT, each captured on an all-ones mask (tests/pipeline/audit_models.py says why right
  padding of a causal model proves nothing);
* Mistral whose sliding window (4) is shorter than most of its batches, on interleaved 1F1B;
* BART (encoder-decoder; one embedding under four names; ``final_logits_bias``, a buffer);
* MobileNetV2 (BatchNorm with momentum 0.997 after every convolution, TensorFlow "same" padding
  computed from the input's size) on replicated stages under zb-h1, against the loop that sums the
  even and the odd micro-batches' gradients apart as its two replicas do: this tiny MobileNetV2 is
  chaotic at lr 0.05 (its last BatchNorms normalise two values) and turns the order's rounding
  (1.9e-6 after one step) into 382 against the in-order loop after three;
* Gemma 2 and Gemma 3 (sliding-window layers of 4 tokens alternating with global ones on 8-token
  sequences; Gemma 2's soft-capped logits; a tied head) on 4 stages.

Measured: DistilBERT 7.5e-9, Llama 0, Mistral 0, BART 7.5e-9, MobileNetV2 1.2e-7 (relative; a
running_var of ~7.8e3 one ulp apart), Gemma 2 and 3 7.5e-9.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from hybridpipe.profiles.capture import training_switches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.audit_models import padded_tokens
from tests.pipeline.harness import make_plan, train_pipeline

pytest.importorskip("transformers")

STEPS, M, B, LR = 3, 4, 2, 0.05
AUDIT = "tests.pipeline.audit_models"
BART = ("hf:BartForConditionalGeneration[encoder_layers=2,decoder_layers=2,d_model=32,encoder_ffn_dim=64,"
        "decoder_ffn_dim=64,encoder_attention_heads=2,decoder_attention_heads=2,vocab_size=128,"
        "max_position_embeddings=64,seq=8,dropout=0]")
MOBILENET = "hf:mobilenet_v2[depth_multiplier=0.25,image_size=32,num_labels=5,dropout=0]"
GEMMA = ("num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=2,"
         "head_dim=16,vocab_size=128,seq=8,sliding_window=4")
GEMMA2 = f"hf:gemma2[{GEMMA}]"              # sliding and global layers alternating, logit soft-capping, tied
GEMMA3 = f"hf:gemma3_text[{GEMMA}]"


def plain_loop(spec_name: str, dataset=None, *, halves: bool = False, seed: int = 0, data_seed: int = 1
               ) -> dict[str, torch.Tensor]:
    """The unsplit model trained in one process: built after ``torch.manual_seed(seed)``, micro-batch m
    of step k = samples (k*M + m)*B .. + B - 1 (synthetic of ``data_seed`` or ``dataset``, its collate_fn),
    its own loss from the labels / M accumulated, SGD lr 0.05 momentum 0.5. ``halves``: the even and
    the odd micro-batches' gradients accumulated apart and then added, the order two replicas sum in."""
    spec = resolve_model(spec_name)
    torch.manual_seed(seed)
    model = spec.build().train()
    data = dataset if dataset is not None else resolve_dataset("synthetic", spec, size=STEPS * M * B, seed=data_seed)
    collate = getattr(data, "collate_fn", None) or default_collate
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    params = [p for p in model.parameters() if p.requires_grad]
    for k in range(STEPS):
        opt.zero_grad()
        parts: list[list[torch.Tensor | None]] = [[None] * len(params), [None] * len(params)]
        for m in range(M):
            batch = collate([data[(k * M + m) * B + i] for i in range(B)])
            (model(**batch, **training_switches(model)).loss / M).backward()
            if halves:
                for i, p in enumerate(params):
                    held = parts[m % 2][i]
                    parts[m % 2][i] = p.grad if held is None else held + p.grad
                    p.grad = None
        if halves:
            for i, p in enumerate(params):
                p.grad = parts[0][i] + parts[1][i]      # type: ignore[operator]
        opt.step()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def distance(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |ours - reference| / max(1, max |reference|) over every weight and floating buffer
    (absolute below 1, relative to the tensor's largest value above), and where; integer buffers
    (num_batches_tracked) must be equal, every tensor of the reference's dtype and shape."""
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    assert all((ours[k].dtype, ours[k].shape) == (v.dtype, v.shape) for k, v in reference.items())
    whole = [k for k, v in reference.items() if not v.is_floating_point()]
    assert all(torch.equal(ours[k], reference[k]) for k in whole), [(k, ours[k], reference[k]) for k in whole]
    return max(((ours[k].double() - v.double()).abs().max().item() / max(1.0, v.double().abs().max().item()), k)
               for k, v in reference.items() if v.is_floating_point())


CASES = {   # spec, cuts (block ids), replicas, schedule, padding side, virtual stages, reference in replica order
    "distilbert-right-2x2-1f1b": (f"{AUDIT}:distilbert_padded", [1], [2, 2], "1f1b", "right", 1, False),
    "llama-left-4-zb-h1": (f"{AUDIT}:llama_left_padded", [1, 2, 3], [1, 1, 1, 1], "zb-h1", "left", 1, False),
    "mistral-window-interleaved": (f"{AUDIT}:mistral_window", [1, 2, 3], [1, 1], "interleaved-1f1b", "left", 2, False),
    "bart-2x2-zb-h1": (BART, [4], [2, 2], "zb-h1", None, 1, False),
    "mobilenet-2x2-zb-h1": (MOBILENET, [8], [2, 2], "zb-h1", None, 1, True),
    "gemma2-window-4-1f1b": (GEMMA2, [1, 2, 3], [1, 1, 1, 1], "1f1b", None, 1, False),
    "gemma3-window-4-1f1b": (GEMMA3, [1, 2, 3], [1, 1, 1, 1], "1f1b", None, 1, False),
}


FAST = {"mistral-window-interleaved"}       # the rest (2-3 s each): make test-slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else (pytest.mark.slow,)) for n in CASES])
def test_family_feature_on_a_pipeline_equals_one_process(name):
    spec, cuts, replicas, schedule, padding, virtual, halves = CASES[name]
    dataset = padded_tokens(n=STEPS * M * B, side=padding) if padding else None
    plan = make_plan(spec, cuts, replicas, schedule=schedule, micro_batches=M, batch_size=B, virtual_stages=virtual)
    ours, losses = train_pipeline(plan, STEPS, lr=LR, dataset=dataset)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    diff, where = distance(ours, plain_loop(spec, dataset, halves=halves))
    print(name, diff, where)
    assert diff <= 1e-6, (diff, where)


@pytest.mark.parametrize("factory,side", [("distilbert_padded", "right"), ("llama_left_padded", "left")])
def test_the_padded_cases_can_fail_the_mask_changes_the_loss(factory, side):
    """The padding cases above compare something the mask decides: the same padded batch without its
    mask gives other logits at the real tokens (so a pipeline that dropped the mask would be caught)."""
    spec = resolve_model(f"{AUDIT}:{factory}")
    torch.manual_seed(0)
    model = spec.build().train()
    data = padded_tokens(n=8, side=side)
    batch = data.collate_fn([data[i] for i in range(8)])
    assert (batch["attention_mask"] == 0).any()
    real = batch["attention_mask"].bool()
    masked = model(**batch, **training_switches(model)).logits[real]
    unmasked = model(**{**batch, "attention_mask": torch.ones_like(batch["attention_mask"])},
                     **training_switches(model)).logits[real]
    assert float((masked - unmasked).abs().max()) > 1e-3      # a thousand times the bound the pipeline meets
