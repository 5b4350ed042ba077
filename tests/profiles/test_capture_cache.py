"""The capture cache (profiles/capture_cache.py): a capture rebuilt from the file is the fresh
capture (same graph signature, blocks and inputs; the same loss and gradients on the model's own
parameters), a change of what it depends on misses the cache, a damaged file is ignored."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpipe.pipeline.stage import captured_signature
from hybridpipe.profiles import capture_cache
from hybridpipe.profiles.capture_cache import cached_capture
from hybridpipe.profiles.zoo import resolve_model


def build(spec_text: str, batch: int = 2):
    spec = resolve_model(spec_text)
    torch.manual_seed(0)
    model = spec.build()
    return spec, model, spec.example_input(batch, torch.Generator().manual_seed(0))


def loss_and_grads(captured, spec, example):
    """One forward and backward of the captured graph as the stages run it (flat inputs in)."""
    captured.module.zero_grad()
    flat = captured.flatten_input(example)
    out = captured.rebuild_output(captured.graph(*[flat[n] for n in captured.inputs]))
    y = out[0] if isinstance(out, tuple | list) else out
    loss = y.float().pow(2).mean() if spec.loss is None else y.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in captured.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", ["mlp[hidden=32,layers=3]", "gpt[layers=2,width=32,heads=2,seq=8,vocab=64]",
                                   pytest.param("resnet-small", marks=pytest.mark.slow)])
def test_a_capture_from_the_cache_is_the_fresh_capture_on_the_models_own_parameters(tmp_path, model, monkeypatch):
    spec, fresh_model, example = build(model)
    fresh = cached_capture(fresh_model, example, directory=tmp_path)
    (written,) = tmp_path.glob("capture-*.json")
    spec, again_model, example = build(model)

    def no_export(*a, **k):
        raise AssertionError("captured again instead of reading the cache")
    monkeypatch.setattr(capture_cache, "capture_model", no_export)
    cached = cached_capture(again_model, example, directory=tmp_path)
    assert captured_signature(cached) == captured_signature(fresh)
    assert cached.blocks == fresh.blocks and cached.inputs == fresh.inputs and cached.constants == fresh.constants
    params = dict(again_model.named_parameters())
    for node in cached.graph.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            assert cached.graph.get_parameter(str(node.target)) is params[str(node.target)]
    loss_a, grads_a = loss_and_grads(fresh, spec, example)
    loss_b, grads_b = loss_and_grads(cached, spec, example)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert json.loads(written.read_text())["format"] == capture_cache.FORMAT


def test_another_shape_or_model_misses_and_a_damaged_file_is_captured_anew(tmp_path):
    _, model, example = build("mlp[hidden=32,layers=3]")
    cached_capture(model, example, directory=tmp_path)
    _, model, bigger = build("mlp[hidden=32,layers=3]", batch=3)
    cached_capture(model, bigger, directory=tmp_path)
    _, other, example = build("mlp[hidden=16,layers=3]")
    cached_capture(other, example, directory=tmp_path)
    files = sorted(tmp_path.glob("capture-*.json"))
    assert len(files) == 3
    for f in files:
        f.write_text('{"format": 1, "nodes": [["call_function", "x", {"$": "fn", "v": "os.system"}, [], {}]]}')
    captured = cached_capture(other, example, directory=tmp_path)
    assert len(captured.blocks) > 0 and captured.front_end == "export"
