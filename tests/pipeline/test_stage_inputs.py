"""A stage's inputs as leaves of its graph (pipeline/stage.py ``_leaf``): a receive's tensors are
marked in place, no ``detach`` dispatched per input; a caller's tensors are left as they were; the
gradients are a plain backward's either way."""

from __future__ import annotations

import torch

from hybridpipe.pipeline.plancheck import build_stage
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture, data_for, make_plan
from tests.pipeline.test_loss_seed import Ops


def _stages():
    plan = make_plan("mlp", [2, 5], [1, 1, 1], micro_batches=2, batch_size=4)
    spec = resolve_model(plan.model)
    stages = [build_stage(capture(spec, plan.batch_size), plan, r, loss=spec.loss) for r in range(3)]
    return stages, data_for(plan, 1).input(0, 0)


def _received(first, batch):
    """Stage 0's outputs as a receive gives them: fresh tensors, no graph."""
    return {k: t.detach().clone() for k, t in first.forward(first.data_inputs(batch)).outputs.items()}


def test_an_owned_input_dispatches_no_detach_and_its_gradient_is_a_plain_backwards():
    torch.manual_seed(0)
    (first, middle, _), batch = _stages()
    got = _received(first, batch)
    ref = {k: t.clone().requires_grad_(True) for k, t in got.items()}
    ops, plain = Ops(), Ops()
    with ops:
        act = middle.forward(got, owned=True)
    assert all(act.inputs[k] is got[k] and got[k].requires_grad for k in got)
    g = {k: torch.randn_like(t) for k, t in act.outputs.items()}
    grads = middle.backward(act, g)
    # the reference: the stage's module in plain PyTorch on leaves of the same values
    with plain:
        out = middle.module(*(ref[k] for k in middle.input_names))
    assert ops.seen == plain.seen, (ops.seen, plain.seen)      # was a detach more per input
    outs = out if isinstance(out, (tuple, list)) else (out,)
    torch.autograd.backward(list(outs), [g[k] for k in middle.output_names])
    assert grads and set(grads) == set(ref)
    for k in grads:
        assert torch.equal(grads[k], ref[k].grad), k


def test_a_callers_input_is_left_as_it_was():
    torch.manual_seed(0)
    (first, middle, _), batch = _stages()
    got = _received(first, batch)
    act = middle.forward(got)
    assert not any(t.requires_grad for t in got.values())        # not marked: the leaves are others
    assert all(act.inputs[k] is not got[k] and act.inputs[k].requires_grad for k in got)
    mine = batch.clone().requires_grad_(True)
    act0 = first.forward(first.data_inputs(mine), owned=True)   # a tensor with grad is detached even owned
    assert all(t is not mine for t in act0.inputs.values())
