"""Cutting a captured model at block ranges: the stages, run one after another, compute exactly the model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.capture import call_args, capture_model
from hybridpipe.profiles.cut import check_cuts, stage_boundaries
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture
from tests.pipeline.models import BareParam, LongSkip, Reused, SizeAcross

GPT = "gpt[layers=1,width=16,heads=2,seq=6,vocab=32]"


def ranges_from_cuts(cuts: list[int], n: int) -> list[tuple[int, int]]:
    bounds = [-1, *sorted(cuts), n - 1]
    return [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]


def composed_loss_and_grads(captured, ranges, loss_fn, x, y):
    """Run the stages one after another, forward then backward, as a pipeline would."""
    model = captured.module
    stages = [build_stage_index(captured, ranges, i, loss=loss_fn) for i in range(len(ranges))]
    acts, cur = [], stages[0].data_inputs(x)
    for s in stages:
        act = s.forward(cur, target=y if s.is_last else None)
        acts.append(act)
        cur = {k: v.detach().clone() for k, v in act.outputs.items()}
    grads = None
    for s, act in zip(reversed(stages), reversed(acts), strict=True):
        grads = s.backward(act, grads)
        grads = {k: g.clone() for k, g in grads.items()}
    assert grads == {}, "stage 0 returns no input gradients"
    return acts[-1].loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stages


def reference(model, loss_fn, x, y):
    model.zero_grad()
    args, kwargs = call_args(x)
    out = model(*args, **kwargs)
    loss = loss_fn(out, y) if loss_fn is not None else out.loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss, grads


def captured_model(model, x, granularity="blocks"):
    return capture_model(model, x, granularity=granularity)


MODELS = st.sampled_from(["resnet-small[norm=none]", GPT, "mlp[layers=3]"])
GRANULARITIES = st.sampled_from(["ops", "modules", "blocks"])


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_name=MODELS, granularity=GRANULARITIES, data=st.data())
def test_any_cut_computes_the_model(model_name, granularity, data):
    """At every granularity down to single aten operations, any set of cuts gives the model's loss
    and gradients, and the stages' state dicts tile the model's (4 cases; 10: make test-slow)."""
    check_any_cut(model_name, granularity, data)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_name=MODELS, granularity=GRANULARITIES, data=st.data())
def test_any_cut_computes_the_model_many(model_name, granularity, data):
    check_any_cut(model_name, granularity, data)


def check_any_cut(model_name, granularity, data) -> None:
    spec = resolve_model(model_name)
    captured = capture(spec, 2, seed=0, granularity=granularity)    # one capture per model and granularity
    torch.manual_seed(0)
    model = spec.build()                                            # the captured model's weights (seed 0)
    g = torch.Generator().manual_seed(1)
    x, y = spec.example_input(2, g), spec.example_target(2, g)
    n = len(captured.blocks)
    cuts = data.draw(st.lists(st.integers(0, n - 2), min_size=0, max_size=min(5, n - 1), unique=True))
    ranges = ranges_from_cuts(cuts, n)
    ref_loss, ref_grads = reference(model, spec.loss, x, y)
    loss, grads, stages = composed_loss_and_grads(captured, ranges, spec.loss, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    keys = [k for s in stages for k in s.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))


def test_skip_connection_is_relayed_through_every_stage_it_jumps():
    model = LongSkip()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    captured = captured_model(model, x, "modules")
    assert [b.name for b in captured.blocks] == ["a", "b", "c", "d", "head"]
    ranges = [(0, 0), (1, 1), (2, 3), (4, 4)]
    bounds = stage_boundaries(captured, ranges)
    assert all("x" in b.inputs for b in bounds) and all("x" in b.outputs for b in bounds[:-1])
    assert [("x" in b.relayed) for b in bounds] == [True, True, True, False]
    loss_fn = torch.nn.functional.cross_entropy
    ref_loss, ref_grads = reference(model, loss_fn, x, y)
    loss, grads, _ = composed_loss_and_grads(captured, ranges, loss_fn, x, y)
    torch.testing.assert_close(loss, ref_loss)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k])


def test_bare_parameter_read_downstream_lives_where_it_is_read():
    model = BareParam()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    captured = captured_model(model, x, "ops")
    mul = next(i for i, b in enumerate(captured.blocks) if b.nodes[0].startswith("mul"))
    ranges = [(0, mul - 1), (mul, len(captured.blocks) - 1)]   # `scale` is read by the second stage only
    loss_fn = torch.nn.functional.cross_entropy
    ref_loss, ref_grads = reference(model, loss_fn, x, y)
    loss, grads, stages = composed_loss_and_grads(captured, ranges, loss_fn, x, y)
    torch.testing.assert_close(grads["scale"], ref_grads["scale"])
    assert "scale" not in stages[0].state_dict() and "scale" in stages[1].state_dict()


def test_tuple_and_int_values_cross_cuts():
    """A chunk's tuple and x.size(0) cross a cut: tensors as numbered entries, the int as metadata."""
    spec = resolve_model(GPT)
    x = spec.example_input(2)
    captured = captured_model(spec.build(), x, "ops")
    names = [b.nodes[0] for b in captured.blocks]
    chunk = names.index("chunk")
    stage = build_stage_index(captured, [(0, chunk), (chunk + 1, len(names) - 1)], 0)
    act = stage.forward(stage.data_inputs(x))
    assert {"chunk.0", "chunk.1", "chunk.2"} <= set(act.outputs)
    model = SizeAcross()
    x, y = torch.randn(2, 8), torch.randint(0, 3, (2,))
    captured = captured_model(model, x, "modules")
    loss_fn = torch.nn.functional.cross_entropy
    loss, grads, stages = composed_loss_and_grads(captured, [(0, 0), (1, 1)], loss_fn, x, y)
    torch.testing.assert_close(loss, reference(model, loss_fn, x, y)[0])
    assert "__meta__" in stages[0].forward(stages[0].data_inputs(x)).outputs


def test_module_used_twice_is_one_parameter_in_two_stages():
    """Reused's Linear is applied before and after `mid`: cut between, both stages hold it (tied)."""
    model = Reused()
    x = torch.randn(4, 8)
    captured = captured_model(model, x, "modules")
    bounds = stage_boundaries(captured, [(0, 0), (1, len(captured.blocks) - 1)])
    assert len(bounds) == 2
    stages = [build_stage_index(captured, [(0, 0), (1, len(captured.blocks) - 1)], i) for i in range(2)]
    assert "shared.weight" in stages[0].state_dict() and "shared.weight" in stages[1].state_dict()


def test_value_that_cannot_travel_blocks_the_cut_with_one_line():
    class Opaque:
        def __init__(self, t):
            self.t = t

    class Carrier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            box = Opaque(self.a(x))
            return self.b(box.t)

    x = torch.randn(2, 4)
    captured = captured_model(Carrier(), x, "modules")
    check_cuts(captured, stage_boundaries(captured, [(0, 0), (1, 1)]))   # the object itself never enters the graph


def test_ranges_that_do_not_tile_the_graph_are_refused():
    captured = captured_model(LongSkip(), torch.randn(2, 8), "modules")
    with pytest.raises(UserError, match="must start at node 3"):
        stage_boundaries(captured, [(0, 2), (4, 4)])
    with pytest.raises(UserError, match="cover 3 nodes but the model has 5"):
        stage_boundaries(captured, [(0, 2)])
