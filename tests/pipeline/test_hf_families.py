"""The model-family matrix of issue 28: nine Hugging Face families x {fp32, bf16} x {4 stages, 2
stages x 2 replicas}, each pipeline (one process, a thread per rank) against a plain single-process
loop written here (per step: each micro-batch's loss / M backpropagated, under ``torch.autocast``
for bf16, then one SGD step), every weight AND buffer compared after 3 steps (integer buffers
such as BatchNorm's num_batches_tracked exactly). fp16 with its dynamic loss scale against
``torch.amp.GradScaler`` on three of them. Three cases in the default suite; the rest: make test-slow.

Families: GPT-2 (decoder, tied embedding cut apart), Mistral (decoder, untied), Gemma (RMSNorm
computing in float32, its embedding scaled by sqrt(hidden), tied), GPT-NeoX (parallel residual,
partial rotary, untied), DistilBERT (encoder, tied MLM head), T5 (encoder-decoder, one embedding
in three places), ConvNeXt (vision: depthwise convolutions, LayerNorm, layer scale), ResNet
(BatchNorm after every convolution: running statistics combined across replicas), Mixtral
(mixture of experts: transformers' grouped experts exported as they are, and its eager loop over
the experts hit as a leaf module, ``leaf=MixtralExperts``). Mixtral here has as many key/value
heads as query heads: with grouped-query attention the captured graph repeats the key/value heads
(Hugging Face's export branch) and bf16 ends 3.2e-5 (8.1e-5 with the leaf) from eager autocast,
on 4 stages and 2x2 alike (test_hf_bf16.py's Llama GQA test shows that branch on one stage).

Measured (3 SGD steps, lr 0.05, momentum 0.5; max |weight or buffer - the plain loop's|):

    family       fp32 4   fp32 2x2  bf16 4   bf16 2x2  fp16 4   fp16 2x2
    gpt2         3.7e-9   3.7e-9    1.9e-9   3.7e-9    3.7e-9   3.7e-9
    mistral      0        7.5e-9    0        0
    gemma        3.7e-9   3.7e-9    3.7e-9   3.7e-9    3.7e-9   3.7e-9
    gpt-neox     0        7.5e-9    0        9.3e-10
    distilbert   3.7e-9   3.7e-9    3.7e-9   3.7e-9
    t5           6.0e-8   1.2e-7    7.9e-6   7.9e-6
    convnext     7.3e-12  7.5e-9    1.6e-11  9.1e-12
    resnet       0        2.4e-7    0        9.5e-7    0        4.8e-7   (2x2: a running_var)
    mixtral      0        7.5e-9    0        3.7e-9
    mixtral-leaf 0        7.5e-9    0        1.9e-9

T5 in bf16: 4 stages end bit-identical to the unsplit captured graph run on one stage (2x2 as far
from the loop); the 7.9e-6 (relative_attention_bias) is between that graph and eager autocast,
not the split (test below). Before bf16 was captured under autocast (5dd7bb4; its parent run with
the Trainer's arguments of then, autocast and a bf16 wire) the bf16 4-stage cases of GPT-2,
Mistral, Gemma, GPT-NeoX and T5 failed at their first forward ("Tensor dtype mismatch! Expected:
Float, Got: c10::BFloat16"), DistilBERT ended 8.8e-5 away and ConvNeXt 2.8e-4 (float32 values
rounded to bf16 at every cut); ResNet passed.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch.utils.data import default_collate

from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, train_pipeline
from tests.pipeline.hf_models import MIXTRAL, MIXTRAL_LEAF

pytest.importorskip("transformers")

STEPS, LR, MOMENTUM, M, B = 3, 0.05, 0.5, 4, 2
TINY = "num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,vocab_size=128,seq=8"
FAMILIES = {    # spec, cuts of 4 stages, cut of 2 (block ids)
    "gpt2": ("hf:gpt2[n_layer=2,n_embd=32,n_head=2,vocab_size=128,seq=8,dropout=0]", [0, 3, 4], [3]),
    "mistral": (f"hf:mistral[{TINY},num_key_value_heads=2]", [1, 2, 3], [2]),
    "gemma": (f"hf:gemma[{TINY},num_key_value_heads=2,head_dim=16]", [1, 2, 3], [2]),
    "gpt-neox": (f"hf:gpt_neox[{TINY}]", [2, 3, 4], [3]),
    "distilbert": ("hf:distilbert[n_layers=2,dim=32,hidden_dim=64,n_heads=2,vocab_size=128,seq=8,dropout=0]",
                   [0, 1, 2], [1]),
    "t5": ("hf:t5[num_layers=2,num_decoder_layers=2,d_model=32,d_ff=64,num_heads=2,d_kv=16,vocab_size=128,"
           "decoder_start_token_id=0,seq=8,dropout=0]", [3, 6, 9], [5]),
    "convnext": ("tests.pipeline.hf_families:hf_convnext", [0, 1, 2], [1]),
    "resnet": ("tests.pipeline.bn_models:hf_resnet", [0, 1, 2], [1]),
    "mixtral": (MIXTRAL.replace("num_key_value_heads=2", "num_key_value_heads=4"), [1, 2, 3], [2]),
    "mixtral-leaf": (MIXTRAL_LEAF.replace("num_key_value_heads=2", "num_key_value_heads=4"), [1, 2, 3], [2]),
}
LAYOUTS = {"4": [1, 1, 1, 1], "2x2": [2, 2]}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FAST = {("gemma", "bf16", "4"), ("distilbert", "bf16", "2x2"), ("resnet", "bf16", "2x2")}
FP16 = ("gpt2", "gemma", "resnet")
TOL = {"fp32": 1e-6, "bf16": 1e-5, "fp16": 1e-5}


@functools.cache
def plain_loop(spec_name: str, precision: str, summed_in: torch.dtype | None = None,
               kept: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The unsplit model trained in one process; its state after STEPS steps (read-only). Built
    after ``torch.manual_seed(0)``; micro-batch m of step k holds synthetic samples (k * M + m) * B
    .. + B - 1 (data seed 1), as the pipeline reads them; its own loss from the labels; under
    ``torch.autocast`` for bf16/fp16, fp16 through ``torch.amp.GradScaler``.

    ``summed_in`` models two replicas summing their gradients in that dtype: the gradients of the
    even and the odd micro-batches are accumulated apart (in float32), each rounded to the dtype,
    added there and cast back, but for the parameters named in ``kept`` (summed in float32)."""
    spec = resolve_model(spec_name)
    torch.manual_seed(0)
    model = spec.build().train()
    samples = resolve_dataset("synthetic", spec, size=STEPS * M * B, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    dtype = PRECISIONS[precision]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if precision == "fp16" else None
    switches = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    params = dict(model.named_parameters())
    for k in range(STEPS):
        opt.zero_grad()
        halves: list[dict[str, torch.Tensor]] = [{}, {}]
        for m in range(M):
            batch = default_collate([samples[(k * M + m) * B + i] for i in range(B)])
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(**batch, **switches).loss / M
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if summed_in is not None:
                for name, p in params.items():
                    if p.grad is not None:
                        half = halves[m % 2]
                        half[name] = half[name] + p.grad if name in half else p.grad.clone()
                        p.grad = None
        if summed_in is not None:
            for name, p in params.items():
                even, odd = halves[0].get(name), halves[1].get(name)
                if even is None or odd is None:
                    p.grad = even if odd is None else odd
                elif name in kept:
                    p.grad = even + odd
                else:
                    p.grad = (even.to(summed_in) + odd.to(summed_in)).float()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def pipelined(family: str, precision: str, layout: str, reduce_dtype: torch.dtype | None = None
              ) -> dict[str, torch.Tensor]:
    """The pipeline's merged weights and buffers after STEPS steps (replicas checked bitwise equal;
    ``reduce_dtype``: they sum their gradients in it, as launch --reduce-dtype)."""
    spec, four, two = FAMILIES[family]
    dtype = PRECISIONS[precision]
    plan = make_plan(spec, four if layout == "4" else two, LAYOUTS[layout], micro_batches=M, batch_size=B,
                     shared_capture=True, autocast=dtype)
    state, losses = train_pipeline(plan, STEPS, lr=LR, shared_capture=True, autocast=dtype, reduce_dtype=reduce_dtype,
                                   loss_scale=2.0**16 if precision == "fp16" else None)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    return state


def distance(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |ours - reference| over every weight and floating buffer, and where; integer
    buffers must be equal and every tensor float32 as the model's are."""
    assert set(ours) == set(reference), set(ours) ^ set(reference)
    worst = (0.0, "")
    for name, ref in reference.items():
        value = ours[name]
        assert value.dtype == ref.dtype and value.shape == ref.shape, (name, value.dtype, ref.dtype)
        if not ref.is_floating_point():
            assert torch.equal(value, ref), (name, value, ref)
            continue
        worst = max(worst, (float((value.double() - ref.double()).abs().max()), name))
    return worst


def cases():
    for family in FAMILIES:
        for precision in ("fp32", "bf16"):
            for layout in LAYOUTS:
                slow = () if (family, precision, layout) in FAST else (pytest.mark.slow,)
                yield pytest.param(family, precision, layout, marks=slow, id=f"{family}-{precision}-{layout}")
    for family in FP16:
        for layout in LAYOUTS:
            yield pytest.param(family, "fp16", layout, marks=pytest.mark.slow, id=f"{family}-fp16-{layout}")


@pytest.mark.parametrize("family,precision,layout", list(cases()))
def test_family_on_a_pipeline_equals_a_plain_loop(family, precision, layout):
    diff, where = distance(pipelined(family, precision, layout), plain_loop(FAMILIES[family][0], precision))
    assert diff <= TOL[precision], (diff, where)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_gradient_sum_between_replicas_costs_what_its_rounding_explains(family):
    """2x2 bf16 with the replicas' gradients summed in bfloat16 (launch --reduce-dtype bf16) ends far
    from the plain loop (measured 1.9e-5 .. 2.7e-4, T5 9.9e-4, ResNet's running_var 4.8e-3: see
    RESULTS 8c) but within the 4-stage bound of the plain loop that rounds each replica's gradient (its
    even / odd micro-batches') to bfloat16 and adds them there: the whole distance is that rounding.
    Summed in float32 (the default) the same 2x2 run is within the 4-stage bound (the matrix).
    Measured against the rounding loop: 0 to 3.7e-9 (ResNet's running_var 4.8e-7, as in float32;
    Mixtral 9.6e-5 and, with the leaf, 3.7e-5 from the plain loop, 0 from the rounding loop);
    T5 4.9e-5 (against 9.9e-4 from the plain loop): its captured graph's gradients differ from eager
    autocast's by ulps (the 7.9e-6 above), enough to round some to the neighbouring bfloat16."""
    spec, _, two = FAMILIES[family]
    plan = make_plan(spec, two, LAYOUTS["2x2"], micro_batches=M, batch_size=B, shared_capture=True,
                     autocast=torch.bfloat16)
    ours = pipelined(family, "bf16", "2x2", reduce_dtype=torch.bfloat16)
    kept = frozenset(t.param for t in plan.tied)        # the tied copies sum in float32
    assert distance(ours, plain_loop(spec, "bf16"))[0] > 1e-6
    diff, where = distance(ours, plain_loop(spec, "bf16", torch.bfloat16, kept))
    assert diff <= (1e-4 if family == "t5" else TOL["bf16"]), (diff, where)


@pytest.mark.slow
def test_t5_bf16_distance_is_the_captures_not_the_splits():
    """T5's 7.9e-6 from eager autocast (its relative_attention_bias) is there on one stage too: the
    captured graph's, which 4 stages reproduce bit for bit."""
    spec = FAMILIES["t5"][0]
    plan = make_plan(spec, [], [1], micro_batches=M, batch_size=B, shared_capture=True, autocast=torch.bfloat16)
    one_stage, _ = train_pipeline(plan, STEPS, lr=LR, shared_capture=True, autocast=torch.bfloat16)
    assert distance(pipelined("t5", "bf16", "4"), one_stage)[0] == 0.0
    assert distance(one_stage, plain_loop(spec, "bf16"))[0] <= TOL["bf16"]
