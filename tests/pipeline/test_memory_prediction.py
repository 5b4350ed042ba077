"""The partitioner's memory prediction against what a stage holds.

Two references: the CPU allocator itself (torch's profiler reports every allocation and free
with the running total), which says what one micro-batch's forward leaves allocated on a stage;
and the engine's ``MemoryMeter``, run through a real 2-stage pipeline (threads), whose per-step
peak the prediction must match within 10% for every schedule, with and without recomputation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import cache

import pytest
import torch

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts, model_costs
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.stagememory import (
    inflight_micro_batches,
    memory_bytes,
    split_micro_batches,
    transient_bytes,
)
from hybridpipe.pipeline.memory import MemoryMeter
from hybridpipe.pipeline.splitback import backward_input
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo import resolve_model
from tests.allocator import allocation_totals, total_at
from tests.pipeline.harness import capture, make_plan, train_pipeline

BATCH = {"mlp": 32, "gpt": 4, "resnet-small": 8}
CUT = {"mlp": 3, "gpt": 3, "resnet-small": 3}      # stage 0 ends at this block


@cache
def _costs(model: str) -> ModelCosts:
    torch.manual_seed(0)
    return model_costs(profile_model(resolve_model(model), batch_size=BATCH[model], repeats=1, warmup=0,
                                     progress=False, split_backward=backward_input))


def _ranges(model: str, costs: ModelCosts) -> list[tuple[int, int]]:
    return [(0, CUT[model]), (CUT[model] + 1, costs.n - 1)]


def _allocated(fn) -> tuple[list[int], list[int]]:
    """Run ``fn(mark)``; the allocator's running total (bytes allocated since the start) at each mark."""
    marks: list[int] = []
    events = allocation_totals(lambda: fn(lambda: marks.append(time.time_ns())))
    return marks, [total_at(events, mark) for mark in marks]


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt", marks=pytest.mark.slow),
                                   pytest.param("resnet-small", marks=pytest.mark.slow)])
@pytest.mark.parametrize("recompute", [False, True])
def test_one_micro_batch_leaves_what_the_profile_predicts_and_the_meter_counts(model, recompute):
    """Per stage: what the allocator still holds after a micro-batch's forward (and loss) is the
    profile's stash (kept bytes when recomputing), and the meter counts the same."""
    costs = _costs(model)
    spec = resolve_model(model)
    captured = capture(spec, BATCH[model])
    ranges = _ranges(model, costs)
    stages = [build_stage_index(captured, ranges, s, loss=spec.loss, recompute=recompute) for s in range(2)]
    g = torch.Generator().manual_seed(0)
    batch, target = spec.example_input(BATCH[model], g), spec.example_target(BATCH[model], g)
    first = stages[0].forward(stages[0].data_inputs(batch))
    sources = [stages[0].data_inputs(batch), {k: v.detach() for k, v in first.outputs.items()}]
    for s, stage in enumerate(stages):
        params = list(stage.parameters())
        meter = MemoryMeter(lambda params=params: params, lambda: 0, torch.device("cpu"), [stage.module])
        kept = []

        def run(mark, stage=stage, source=sources[s], meter=meter, kept=kept) -> None:
            warm = stage.forward({k: v.clone() for k, v in source.items()})     # one-time allocations
            if stage.is_last:
                warm.loss = stage.loss(warm.output, target)
            del warm
            mark()
            for m in range(2):
                inputs = {k: v.clone() for k, v in source.items()}
                with meter.forward():
                    act = stage.forward(inputs)
                    if stage.is_last:
                        act.loss = stage.loss(act.output, target.clone())   # each its own, as loaded
                meter.hold(m, act.inputs, act.outputs, act.output, act.loss)
                kept.append(act)
                del inputs, act
                mark()

        _, totals = _allocated(run)
        i, j = ranges[s]
        predicted = costs.kept_bytes(i, j) if recompute else costs.stash_bytes(i, j)
        per_micro_batch = [b - a for a, b in zip(totals, totals[1:], strict=False)]
        assert per_micro_batch[0] == per_micro_batch[1] > 0
        # torch.utils.checkpoint also keeps the CPU generator's state (5056 bytes) per micro-batch: not counted
        slack = 6000 if recompute else 256
        assert meter.held == pytest.approx(totals[-1] - totals[0], rel=0.01, abs=2 * slack)   # sees what is held
        assert predicted == pytest.approx(per_micro_batch[0], rel=0.01, abs=slack), (s, predicted, per_micro_batch)


@pytest.mark.parametrize("model", ["mlp", pytest.param("gpt", marks=pytest.mark.slow)])
def test_the_input_half_leaves_what_the_profile_predicts(model):
    """Per stage, as the engine runs a split backward (zb-h1): after a micro-batch's input half the
    meter counts what the profile's ``half_bytes`` predicts: what the weight half reads (less than
    its stash where the input half frees the graph; the stash on the first stage, whose input half
    computes nothing) and the gradients the input half recorded for it (``recorded_bytes``: the
    first stage's, its outputs')."""
    costs = _costs(model)
    spec = resolve_model(model)
    captured = capture(spec, BATCH[model])
    ranges = _ranges(model, costs)
    stages = [build_stage_index(captured, ranges, s, loss=spec.loss) for s in range(2)]
    g = torch.Generator().manual_seed(0)
    batch, target = spec.example_input(BATCH[model], g), spec.example_target(BATCH[model], g)
    first = stages[0].forward(stages[0].data_inputs(batch))
    sources = [stages[0].data_inputs(batch), {k: v.detach().requires_grad_(v.requires_grad)
                                              for k, v in first.outputs.items()}]
    for s, stage in enumerate(stages):
        params = list(stage.parameters())
        meter = MemoryMeter(lambda params=params: params, lambda: 0, torch.device("cpu"), [stage.module])
        with meter.forward():
            act = stage.forward({k: v.clone().detach().requires_grad_(v.requires_grad) for k, v in sources[s].items()})
            if stage.is_last:
                act.loss = stage.loss(act.output, target)
        meter.hold(0, act.inputs, act.outputs, act.output, act.loss)
        grads = None if stage.is_last else {k: torch.randn_like(v) for k, v in act.outputs.items()}
        _, work = stage.backward_input(act, grads)
        i, j = ranges[s]
        half, recorded = costs.half_bytes(i, j), costs.recorded_bytes(i, j)
        meter.hold(0, work.held())
        assert meter.held == pytest.approx(half - recorded, rel=0.01, abs=256), (s, costs.stash_bytes(i, j))
        meter.hold(0, work.recorded())
        assert meter.held == pytest.approx(half, rel=0.01, abs=256), (s, recorded)
        assert recorded > 0
        if s > 0:
            assert half - recorded < costs.stash_bytes(i, j)     # the loss's at least (mlp); gpt: -44%
        else:
            assert half - recorded == costs.stash_bytes(i, j)
            assert recorded == costs.cut_grad_bytes[j]          # its outputs' gradients


def _measured_vs_predicted(model: str, schedule: str, recompute: bool, micro_batches: int = 4):
    costs = _costs(model)
    ranges = _ranges(model, costs)
    plan = make_plan(model, [ranges[0][1]], [1, 1], schedule=schedule, micro_batches=micro_batches,
                     batch_size=BATCH[model], shared_capture=True)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=recompute) for s in plan.stages))
    results: dict = {}
    train_pipeline(plan, 2, step_results=results, shared_capture=True)
    opts = Options(schedule=get_schedule(schedule), micro_batches=micro_batches)
    rows = []
    for s, (i, j) in enumerate(ranges):
        inflight = inflight_micro_batches(get_schedule(schedule), micro_batches, 2 - s, 1, 2)
        split = split_micro_batches(get_schedule(schedule), micro_batches, 2 - s, 1, 2)
        # the meter counts held tensors, not kernels' temporaries: tests/pipeline/test_memory_transient.py
        predicted = (memory_bytes(costs, i, j, inflight, opts, recompute=recompute, split=split)
                     - transient_bytes(costs, i, j))
        static = float(costs.param_bytes[i:j + 1].sum()) * (2 + OPTIMIZER_STATES["sgd"])
        rows.append((max(r.peak_memory_bytes for r in results[s]), predicted, static))
    return rows


def _case(model: str, schedule: str, recompute: bool):
    # zb-h1 with recomputation on gpt: the split backward's two graph tasks (input half, weight half) each
    # rerun the forward; with the recorded gradients predicted, stage 1 is 87.71 MB measured vs 83.55
    # predicted (-4.7%; 92.93 vs 88.73 before the input half took layer norm's gradients, in one pass too)
    marks = [] if model == "mlp" else [pytest.mark.slow]
    return pytest.param(model, schedule, recompute, marks=marks, id=f"{model}-{schedule}-{recompute}")


@pytest.mark.parametrize("model, schedule, recompute", [
    _case(m, s, r) for m in ("mlp", "gpt", "resnet-small") for s in ("gpipe", "1f1b", "zb-h1") for r in (False, True)])
def test_prediction_within_ten_percent_of_the_engines_measured_peak(model, schedule, recompute):
    for s, (measured, predicted, static) in enumerate(_measured_vs_predicted(model, schedule, recompute)):
        assert predicted == pytest.approx(measured, rel=0.10), (s, measured, predicted)
        # the activations alone too (weights, gradients and momentum are the same on both sides)
        assert predicted - static == pytest.approx(measured - static, rel=0.10), (s, measured, predicted, static)


BIG_VOCABULARY = "gpt[layers=1,width=16,heads=2,seq=16,vocab=4096]"     # logits 4 x 16 x 4096 floats: 1 MiB


def test_a_big_vocabulary_head_holds_its_logits_gradient_until_the_weight_half():
    """The last stage (final layer norm and LM head) of a model whose logits dwarf its hidden states,
    after one micro-batch's forward, loss and input half (zb-h1): what the CPU allocator still holds
    is the profile's ``half_bytes``, half of it the logits' gradient (recorded for the head's weight
    gradient; the other half the logits, the output kept until W), and the meter counts the same.
    Without the recorded gradients (on both sides, as before) prediction and meter agreed with each
    other and were 2x under the allocator."""
    spec = resolve_model(BIG_VOCABULARY)
    batch_size = 4
    torch.manual_seed(0)
    costs = model_costs(profile_model(spec, batch_size=batch_size, repeats=1, warmup=0, progress=False,
                                      split_backward=backward_input))
    captured = capture(spec, batch_size)
    ranges = [(0, costs.n - 3), (costs.n - 2, costs.n - 1)]
    first, stage = (build_stage_index(captured, ranges, s, loss=spec.loss) for s in range(2))
    g = torch.Generator().manual_seed(0)
    batch, target = spec.example_input(batch_size, g), spec.example_target(batch_size, g)
    source = {k: v.detach().requires_grad_(v.requires_grad)
              for k, v in first.forward(first.data_inputs(batch)).outputs.items()}
    params = list(stage.parameters())
    meter = MemoryMeter(lambda: params, lambda: 0, torch.device("cpu"), [stage.module])
    kept = []

    def micro_batch(counted: bool) -> None:
        with meter.forward() if counted else contextlib.nullcontext():
            act = stage.forward({k: v.clone().detach().requires_grad_(v.requires_grad) for k, v in source.items()})
            act.loss = stage.loss(act.output, target.clone())
        if counted:
            meter.hold(0, act.inputs, act.outputs, act.output, act.loss)
        _, work = stage.backward_input(act)
        if counted:
            meter.hold(0, work.held(), work.recorded())
        kept.append((act, work))

    def run(mark) -> None:
        micro_batch(counted=False)
        stage.backward_weight(kept.pop()[1])    # one-time allocations: the weights' gradients
        mark()
        micro_batch(counted=True)
        mark()

    _, totals = _allocated(run)
    held = totals[1] - totals[0]
    i, j = ranges[1]
    half, recorded = costs.half_bytes(i, j), costs.recorded_bytes(i, j)
    assert recorded >= 4 * 16 * 4096 * 4          # the logits' gradient, beside the logits (the output, kept)
    assert half == pytest.approx(held, rel=0.01, abs=256), (half, recorded, held)
    assert meter.held == pytest.approx(held, rel=0.01, abs=256)
    assert half - recorded < 0.55 * held          # what both sides counted before: half of it
