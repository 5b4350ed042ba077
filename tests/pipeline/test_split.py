"""Stage building: cutting a traced model at node ranges must compute exactly the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.pipeline.split import stage_boundaries
from hybridpipe.pipeline.stage import build_stage, build_stage_index
from hybridpipe.profiles.trace import trace_model
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan
from tests.pipeline.models import BareParam, LongSkip, Reused, SizeAcross

GPT = "gpt[layers=1,width=16,heads=2,seq=6,vocab=32]"


def ranges_from_cuts(cuts: list[int], n: int) -> list[tuple[int, int]]:
    bounds = [-1, *sorted(cuts), n - 1]
    return [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]


def composed_loss_and_grads(model, gm, ranges, loss_fn, x, y):
    """Run the stages one after another, forward then backward, as a pipeline would."""
    stages = [build_stage_index(gm, ranges, i, loss=loss_fn) for i in range(len(ranges))]
    acts, cur = [], {stages[0].input_names[0]: x}
    for s in stages:
        act = s.forward(cur, target=y if s.is_last else None)
        acts.append(act)
        cur = {k: v.detach().clone() for k, v in act.outputs.items()}
    grads = None
    for s, act in zip(reversed(stages), reversed(acts), strict=True):
        grads = s.backward(act, grads)
        grads = {k: g.clone() for k, g in grads.items()}
    assert grads == {}, "stage 0 returns no input gradients"
    return acts[-1].loss, {n: p.grad.clone() for n, p in model.named_parameters()}, stages


def reference(model, loss_fn, x, y):
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss, grads


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_name=st.sampled_from(["resnet-small[norm=none]", GPT, "mlp[layers=3]"]), data=st.data())
def test_any_cut_computes_the_model(model_name, data):
    spec = resolve_model(model_name)
    torch.manual_seed(0)
    model = spec.build()
    gm = trace_model(model, spec.leaf_modules)
    n = len(gm.graph.nodes)
    cuts = data.draw(st.lists(st.integers(0, n - 2), min_size=0, max_size=min(5, n - 1), unique=True))
    ranges = ranges_from_cuts(cuts, n)
    g = torch.Generator().manual_seed(1)
    x, y = spec.example_input(2, g), spec.example_target(2, g)
    ref_loss, ref_grads = reference(model, spec.loss, x, y)
    loss, grads, stages = composed_loss_and_grads(model, gm, ranges, spec.loss, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))


def test_skip_connection_is_relayed_through_every_stage_it_jumps():
    model = LongSkip()
    gm = trace_model(model)
    ranges = [(0, 2), (3, 4), (5, 7), (8, 11)]
    bounds = stage_boundaries(gm, ranges)
    assert all("x" in b.inputs for b in bounds) and all("x" in b.outputs for b in bounds[:-1])
    assert [("x" in b.relayed) for b in bounds] == [True, True, True, False]
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss_fn = torch.nn.functional.cross_entropy
    ref_loss, ref_grads = reference(model, loss_fn, x, y)
    loss, grads, _ = composed_loss_and_grads(model, gm, ranges, loss_fn, x, y)
    torch.testing.assert_close(loss, ref_loss)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k])


def test_bare_parameter_used_downstream_gets_its_gradient_back():
    model = BareParam()
    gm = trace_model(model)
    ranges = [(0, 1), (2, 3), (4, 6)]        # `scale` lives on stage 0, is multiplied in on stage 2
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss_fn = torch.nn.functional.cross_entropy
    ref_loss, ref_grads = reference(model, loss_fn, x, y)
    loss, grads, stages = composed_loss_and_grads(model, gm, ranges, loss_fn, x, y)
    torch.testing.assert_close(grads["scale"], ref_grads["scale"])
    assert "scale" in stages[0].state_dict() and "scale" not in stages[2].state_dict()


def test_tuple_values_cross_cuts_as_numbered_tensors():
    spec = resolve_model(GPT)
    gm = trace_model(spec.build(), spec.leaf_modules)
    names = [n.name for n in gm.graph.nodes]
    chunk = names.index("chunk")
    stage = build_stage_index(gm, [(0, chunk), (chunk + 1, len(names) - 1)], 0)
    act = stage.forward({"idx": spec.example_input(2)})
    assert {"chunk.0", "chunk.1", "chunk.2"} <= set(act.outputs)


def test_module_used_in_two_stages_is_refused():
    gm = trace_model(Reused())
    with pytest.raises(UserError, match="'shared' is used by stages 0 and 1"):
        stage_boundaries(gm, [(0, 1), (2, 4)])
    stage_boundaries(gm, [(0, 0), (1, 4)])       # both uses in one stage is fine


def test_non_tensor_crossing_a_cut_is_a_clear_error():
    gm = trace_model(SizeAcross())
    stage = build_stage_index(gm, [(0, 2), (3, 5)], 0)
    with pytest.raises(UserError, match="'size' crosses a stage boundary .* holds a int"):
        stage.forward({"x": torch.randn(2, 8)})


def test_ranges_that_do_not_tile_the_graph_are_refused():
    gm = trace_model(LongSkip())
    with pytest.raises(UserError, match="must start at node 3"):
        stage_boundaries(gm, [(0, 2), (4, 11)])
    with pytest.raises(UserError, match="cover 9 graph nodes but the model has 12"):
        stage_boundaries(gm, [(0, 2), (3, 8)])


def test_build_stage_refuses_a_plan_for_another_model_batch_or_world():
    plan = make_plan("mlp", [2], [1, 1])
    spec = resolve_model("mlp")
    model = spec.build()
    stage = build_stage(model, plan, 1, loss=spec.loss, model_name="mlp", batch_size=plan.batch_size, world_size=2)
    assert stage.index == 1 and stage.is_last
    bad = [(dict(model_name="gpt"), "made for model 'mlp', not 'gpt'"),
           (dict(batch_size=8), "batch size 4, not 8"),
           (dict(world_size=3), "needs 2 workers but the job has 3")]
    for kwargs, message in bad:
        with pytest.raises(UserError, match=message) as e:
            build_stage(model, plan, 0, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="covers 11 graph nodes but the model has"):
        build_stage(resolve_model("mlp[layers=5]").build(), plan, 0)
    with pytest.raises(UserError, match="traced graph differs"):
        build_stage(model, dataclasses.replace(plan, profile_signature="0123456789abcdef"), 0)
    with pytest.raises(UserError, match="rank 5 has no stage"):
        build_stage(model, plan, 5)
