"""Memory measured: the bytes a stage holds, against what autograd provably keeps, and the
refusal of a plan that needs more than its workers have."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import check_plan_memory
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.memory import MemoryMeter, tensors_bytes
from tests.pipeline.harness import make_plan, train_pipeline


def _chain() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def test_meter_counts_each_saved_storage_once_until_the_graph_is_freed():
    model = _chain()
    params = list(model.parameters())
    meter = MemoryMeter(lambda: params, lambda: tensors_bytes(params), torch.device("cpu"))
    x = torch.randn(16, 8, requires_grad=True)
    meter.begin_step()
    with meter.forward():
        out = model(x)
    # Linear 1 saves x; tanh saves its output, which Linear 2 saves too (one storage); weights are not counted
    assert meter.held == 16 * 8 * 4 + 16 * 32 * 4
    out.sum().backward()
    del out
    assert meter.held == 0
    assert meter.end_step() == 16 * 8 * 4 + 16 * 32 * 4 + 2 * tensors_bytes(params)


def peaks(schedule: str, recompute: bool, micro_batches: int = 8) -> dict[int, int]:
    plan = make_plan("mlp", [2, 5], [1, 1, 1], schedule=schedule, micro_batches=micro_batches, batch_size=32)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=recompute) for s in plan.stages))
    results: dict = {}
    train_pipeline(plan, 2, step_results=results)
    return {r: max(x.peak_memory_bytes for x in v) for r, v in results.items()}


def test_engine_reports_peaks_that_follow_the_schedules_and_recomputation():
    gpipe, one = peaks("gpipe", False), peaks("1f1b", False)
    assert all(gpipe[r] > one[r] > 0 for r in gpipe)              # gpipe holds all 8 micro-batches
    fewer, more = peaks("gpipe", False, micro_batches=4), peaks("gpipe", False, micro_batches=16)
    for r in gpipe:                         # activations grow with the micro-batches held, the rest stays
        assert more[r] - gpipe[r] == 2 * (gpipe[r] - fewer[r]) > 0
    recomputed = peaks("gpipe", True)
    assert all(recomputed[r] < gpipe[r] for r in gpipe)           # only the stage inputs are kept


def test_a_plan_that_needs_more_memory_than_its_workers_have_is_refused():
    plan = make_plan("mlp", [2, 5], [1, 1, 1])
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], memory_bytes=int(plan.cluster.memory_gb * 1e9) + 1)
    check_plan_memory(plan)
    with pytest.raises(UserError, match=r"stage 1 is predicted to need .*\(--recompute auto"):
        check_plan_memory(dataclasses.replace(plan, stages=tuple(stages)))


def test_meter_counts_a_recomputing_forwards_rerun_and_releases_all_of_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    params = list(model.parameters())
    meter = MemoryMeter(lambda: params, lambda: 0, torch.device("cpu"), [model])
    x = torch.randn(16, 8, requires_grad=True)
    meter.begin_step()
    for _ in range(3):                       # the same storages come back step after step: counts must not creep
        with meter.forward():
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        kept = meter.held                    # checkpoint saves only the input
        assert kept == 16 * 8 * 4
        with meter.backward(True, model):
            out.sum().backward()
        del out
        assert meter.held == 0
    # the rerun: x, the Linear's output (BatchNorm's input), its mean and inverse std (not requiring
    # grad), tanh's output (saved by tanh and the last Linear: one storage)
    assert meter.peak == 16 * 8 * 4 + 16 * 32 * 4 + 2 * 32 * 4 + 16 * 32 * 4


class _EveryThird(PipelineEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, memory_every=3, **kwargs)


def test_steps_the_meter_skips_cost_no_hook_and_train_the_same(monkeypatch):
    """memory_every=3 measures steps 0, 1 and 3 of 5, as the every-step meter does, and sets no
    saved-tensor hook on steps 2 and 4 (counted); the training is bitwise the same."""
    plan = make_plan("mlp", [2, 5], [1, 1, 1], schedule="1f1b", micro_batches=4, batch_size=8)
    packs = [0]
    real = MemoryMeter._pack

    def pack(self, t):
        packs[0] += 1
        return real(self, t)

    monkeypatch.setattr(MemoryMeter, "_pack", pack)
    runs = {}
    for name, engine in (("every", PipelineEngine), ("sampled", _EveryThird)):
        packs[0], results = 0, {}
        state, losses = train_pipeline(plan, 5, step_results=results, engine_class=engine)
        runs[name] = (state, losses, {r: [x.peak_memory_bytes for x in v] for r, v in results.items()}, packs[0])
    (state, losses, every, n_every), (state3, losses3, sampled, n_sampled) = runs["every"], runs["sampled"]
    assert losses3 == losses and all(torch.equal(state3[k], state[k]) for k in state)
    for r in every:
        assert sampled[r] == [p if s in (0, 1, 3) else 0 for s, p in enumerate(every[r])] and min(every[r]) > 0
    assert n_sampled * 5 == n_every * 3 > 0
