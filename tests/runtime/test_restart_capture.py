"""A restarted worker reads the capture its first attempt made (issue 31 item 8): the seeded
build of a multi-stage plan (parameters on the meta device, runtime/seeded.py) goes through the
capture cache too, the capture made before the run directory existed is written once it does
(``Model.keep_capture``), and a model rebuilt from the cache trains as the freshly captured one:
every stage's parameters, loss and gradients bitwise equal. The capture without weights is the
CPU's graph (profiles/meta.py: fake CPU tensors), so a whole build reads the same file."""

from __future__ import annotations

import torch

from hybridpipe.profiles import capture_cache
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.parts import build_model
from tests.pipeline.harness import make_plan

SEED = 3
MODEL = "mlp[hidden=32,layers=3]"


def loss_and_grads(model, example):
    """One forward and backward of the whole captured graph on its (materialized) parameters."""
    captured = model.captured
    captured.module.zero_grad()
    flat = captured.flatten_input(example)
    out = captured.rebuild_output(captured.graph(*[flat[n] for n in captured.inputs]))
    loss = (out[0] if isinstance(out, tuple | list) else out).float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in captured.module.named_parameters() if p.grad is not None}


def test_the_seeded_build_of_a_restart_reads_the_capture_of_the_first_attempt(tmp_path, monkeypatch):
    spec = resolve_model(MODEL)
    plan = make_plan(MODEL, [0, 1, 2], [1, 1, 1, 1], batch_size=2)
    cache = tmp_path / "run" / "capture"                 # the run directory does not exist yet
    first = build_model(spec, plan, seed=SEED, cache=cache)
    assert first.recipe is not None and all(p.is_meta for p in first.module.parameters())
    assert not (tmp_path / "run").exists()               # a job refused now leaves nothing
    (tmp_path / "run").mkdir()
    first.keep_capture()
    (written,) = cache.glob("capture-*.json")

    def no_export(*a, **k):
        raise AssertionError("captured again instead of reading the cache")
    monkeypatch.setattr(capture_cache, "capture_model", no_export)
    again = build_model(spec, plan, seed=SEED, cache=cache)
    again.keep_capture()
    assert list(cache.glob("capture-*.json")) == [written]
    assert again.captured.blocks == first.captured.blocks and again.captured.inputs == first.captured.inputs
    everything = list(range(len(plan.stages)))
    first.materialize(plan, everything)
    again.materialize(plan, everything)
    a, b = dict(first.module.named_parameters()), dict(again.module.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    example = spec.example_input(plan.batch_size, torch.Generator().manual_seed(SEED))
    loss_a, grads_a = loss_and_grads(first, example)
    loss_b, grads_b = loss_and_grads(again, example)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() == a.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)

    whole = build_model(spec, plan, seed=SEED, cache=cache, whole=True)   # the same graph: the same file read
    whole.keep_capture()
    assert list(cache.glob("capture-*.json")) == [written] and whole.captured.blocks == first.captured.blocks
