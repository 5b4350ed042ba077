"""Mixtures of experts through the pipeline (one process, a thread per rank): Mixtral and Qwen2-MoE
(tiny configs), with transformers' default experts code (a torch.library operator with its own
backward, exported as one call) and with its eager loop over the experts hit kept whole as a leaf
module (``leaf=MixtralExperts``: data-dependent routing run as written inside its stage), and a
user's eager mixture of experts with a custom autograd Function inside the leaf. Every case trains
equal to a plain single-process loop written here (weights and buffers, fp32, within 1e-6) on 4
stages and on 2 stages x 2 replicas. (Under real processes: tests/runtime/test_moe_launch.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture_copy, data_for, make_plan, train_pipeline
from tests.pipeline.hf_models import MIXTRAL, MIXTRAL_EAGER, MIXTRAL_LEAF, QWEN2_MOE, QWEN2_MOE_LEAF

pytest.importorskip("transformers")

STEPS, LR, MOMENTUM = 3, 0.05, 0.5          # the harness's SGD
USER_MOE = "tests.profiles.moe_models:moe[leaf=Experts]"
LAYOUTS = {"4": ([1, 2, 3], [1, 1, 1, 1]), "2x2": ([2], [2, 2])}   # blocks: embeddings, rotary, layer 0, layer 1, ...
USER_LAYOUTS = {"4": ([0, 1, 2], [1, 1, 1, 1]), "2x2": ([1], [2, 2])}   # blocks: inp, blocks.0, blocks.1, head
CASES = {"mixtral-leaf": MIXTRAL_LEAF, "qwen2_moe-leaf": QWEN2_MOE_LEAF, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE,
         "user-moe": USER_MOE}
# the default suite: each Hugging Face model once, both layouts and both experts codes among them (the
# user's MoE trains in tests/profiles/test_leaves.py and tests/runtime/test_moe_launch.py); the rest:
# make test-slow
FAST = {("mixtral-leaf", "2x2", "1f1b"), ("qwen2_moe", "4", "gpipe")}


def plain_training(spec_name: str, plan, steps: int) -> dict[str, torch.Tensor]:
    """One process, no pipeline: the model built from seed 0, SGD with momentum on each step's global
    batch (the M micro-batches together; every micro-batch has as many tokens, so the mean loss over
    it is the pipeline's mean of micro-batch means)."""
    spec = resolve_model(spec_name)
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = data_for(plan, steps)
    for k in range(steps):
        x, y = data.global_batch(k)
        opt.zero_grad()
        if isinstance(x, dict):                              # the model's own loss from labels
            loss = model(**x, **({"use_cache": False} if spec_name.startswith("hf:") else {}))["loss"]
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def matrix():
    for name in CASES:
        for layout in LAYOUTS:
            for schedule in ("gpipe", "1f1b"):
                slow = () if (name, layout, schedule) in FAST else (pytest.mark.slow,)
                yield pytest.param(name, layout, schedule, marks=slow, id=f"{name}-{layout}-{schedule}")


@pytest.mark.parametrize("name,layout,schedule", list(matrix()))
def test_mixture_of_experts_trains_equal_to_one_process(name, layout, schedule):
    spec = CASES[name]
    cuts, replicas = (USER_LAYOUTS if name == "user-moe" else LAYOUTS)[layout]
    plan = make_plan(spec, cuts, replicas, schedule=schedule, micro_batches=4, batch_size=2, shared_capture=True)
    ours, losses = train_pipeline(plan, STEPS, lr=LR, shared_capture=True)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    reference = plain_training(spec, plan, STEPS)
    assert max_diff(ours, reference) <= 1e-6
    torch.manual_seed(0)
    assert max_diff(ours, resolve_model(spec).build().state_dict()) > 1e-4        # it did train


def test_data_dependent_experts_error_names_the_class_and_its_leaf_captures():
    """The eager experts loop cannot be exported: the error names MixtralExperts and suggests
    --leaf MixtralExperts; with that leaf the model captures (the leaf one call of the module) and
    the graph computes the model's loss, for the example's shapes and for others."""
    spec = resolve_model(MIXTRAL_EAGER)
    torch.manual_seed(0)
    with pytest.raises(UserError) as err:
        capture_model(spec.build(), spec.example_input(2))
    message = str(err.value)
    assert "(in MixtralExperts.forward)" in message and "\n" not in message, message
    assert re.findall(r"--leaf (\w+)", message) == ["MixtralExperts"], message
    c = capture_copy(resolve_model(MIXTRAL_LEAF), 2)
    assert c.front_end == "export"
    leaves = [n for n in c.graph.graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in leaves] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for batch, seq in ((2, 8), (3, 5)):
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch))
        x = {"input_ids": ids, "labels": ids}
        flat = c.flatten_input(x)
        got = c.rebuild_output(c.graph(*(flat[name] for name in c.inputs))).loss
        assert torch.equal(got, c.module(**x, use_cache=False).loss)


def test_custom_autograd_function_error_names_the_calling_class_and_the_leaf_keeps_its_backward():
    """A dict-input model whose nested module (layers.N.scale, a GradScale) calls a custom autograd
    Function: the refusal names GradScale; with --leaf GradScale the model is exported, the Function
    runs as written, and 2 pipeline stages train equal to one process (the Function's backward
    negates a gradient: the derivative of its forward would train another model)."""
    spec = resolve_model("tests.profiles.moe_models:scaled")
    torch.manual_seed(0)
    with pytest.raises(UserError) as err:
        capture_model(spec.build(), spec.example_input(4))
    message = str(err.value)
    assert "Function _ScaleGrad (in GradScale.forward)" in message and "\n" not in message, message
    assert re.findall(r"--leaf (\w+)", message) == ["GradScale"], message
    name = "tests.profiles.moe_models:scaled[leaf=GradScale]"
    plan = make_plan(name, [1], [1, 1], micro_batches=2, batch_size=2, shared_capture=True)
    assert capture_copy(resolve_model(name), 2).front_end == "export"
    ours, _ = train_pipeline(plan, STEPS, lr=LR, shared_capture=True)
    assert max_diff(ours, plain_training(name, plan, STEPS)) <= 1e-6
    identity = "tests.profiles.moe_models:scaled[factor=1.0]"           # no gradient reversal: another result
    assert max_diff(plain_training(identity, plan, STEPS), plain_training(name, plan, STEPS)) > 1e-4
