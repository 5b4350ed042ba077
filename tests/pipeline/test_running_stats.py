"""BatchNorm statistics (and every other buffer) on replicated and recomputing stages against a plain
single-process loop written here: micro-batches in order, each one's mean loss / M accumulated
(what batch norm's per-micro-batch statistics make the reference), SGD with momentum 0.5 as the
harness's pipelines use. After every step, on every rank: weights and every buffer within 1e-6,
num_batches_tracked exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from hybridpipe.errors import UserError
from hybridpipe.pipeline.buffer_writes import BATCH_NORM, COUNTER, OTHER, buffer_writes
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture, make_plan, train_pipeline

LR, STEPS, TOL = 0.05, 2, 1e-6
BN_MLP = "tests.pipeline.bn_models:bn_mlp"
CASES = {   # model, cuts, replicas, micro-batches, batch size
    "resnet-small": ("resnet-small", [4], [2, 2], 4, 2),
    "bn-mlp": (BN_MLP, [4], [2, 2], 4, 4),
    "bn-mlp-cumulative": ("tests.pipeline.bn_models:bn_mlp_cumulative", [4], [2, 2], 4, 4),
    "counted": ("tests.pipeline.bn_models:counted", [0], [2, 2], 4, 4),
    "shared-norm": ("tests.pipeline.bn_models:shared_norm", [0], [1, 2], 4, 4),
    "hf-resnet": ("tests.pipeline.bn_models:hf_resnet", [1], [2, 2], 4, 2),
}


@functools.cache
def plain_loop(model: str, steps: int, micro_batches: int, batch_size: int, *, seed: int = 0,
               data_seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """The unsplit model trained in one process; its state_dict after every step (read-only)."""
    spec = resolve_model(model)
    torch.manual_seed(seed)
    net = spec.build().train()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.5)
    samples = resolve_dataset("synthetic", spec, size=steps * micro_batches * batch_size, seed=data_seed)
    states = []
    for k in range(steps):
        opt.zero_grad()
        for m in range(micro_batches):
            first = (k * micro_batches + m) * batch_size
            batch = default_collate([samples[i] for i in range(first, first + batch_size)])
            if spec.loss is None:                    # a Hugging Face model computes its own from the labels
                loss = net(**batch).loss
            else:
                x, y = batch
                loss = F.cross_entropy(net(x), y)
            (loss / micro_batches).backward()
        opt.step()
        states.append({name: t.detach().clone() for name, t in net.state_dict().items()})
    return states


def pipelined(plan, steps: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """(rank, step) -> the state_dict of the rank's stage (each of its chunks) after the step."""
    seen: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def observe(rank: int, step: int, stage) -> None:
        seen.setdefault((rank, step), {}).update({k: v.detach().clone() for k, v in stage.module.state_dict().items()})
    train_pipeline(plan, steps, lr=LR, observe=observe, shared_capture=True)
    return seen


def worst(seen: dict[tuple[int, int], dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]
          ) -> tuple[float, str]:
    """The largest difference of any weight or buffer on any rank after any step (counters must be exact)."""
    out = (0.0, "")
    for (rank, step), state in seen.items():
        for name, value in state.items():
            ref = reference[step][name]
            if not value.is_floating_point():
                assert torch.equal(value, ref), f"rank {rank} step {step}: {name} = {value} vs {ref}"
                continue
            diff = float((value.double() - ref.double()).abs().max())
            out = max(out, (diff, f"rank {rank} step {step} {name}"))
    return out


def check(case: str, schedule: str, recompute: bool = False, virtual_stages: int = 1, cuts=None,
          replicas=None) -> None:
    model, default_cuts, default_replicas, M, B = CASES[case]
    plan = make_plan(model, cuts or default_cuts, replicas or default_replicas, schedule=schedule, micro_batches=M,
                     batch_size=B,
                     shared_capture=True, recompute=recompute, virtual_stages=virtual_stages)
    seen = pipelined(plan, STEPS)
    assert {r for r, _ in seen} == set(range(plan.world_size))
    diff, where = worst(seen, plain_loop(model, STEPS, M, B))
    assert diff <= TOL, (diff, where)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("case", ["resnet-small", "bn-mlp"])
def test_replicated_batch_norm_equals_one_process(case, schedule):
    """2 stages x 2 replicas: every replica's running statistics after every step are one
    process's (before: each replica counted only its own micro-batches, num_batches_tracked 6
    instead of 12, running_var off)."""
    check(case, schedule)


@pytest.mark.slow
def test_hugging_face_resnet_on_two_by_two_equals_one_process():
    """transformers' ResNetForImageClassification (BatchNorm2d everywhere, its own loss from ``labels``)."""
    check("hf-resnet", "1f1b")


@pytest.mark.slow
def test_cumulative_batch_norm_on_fx_modules_equals_one_process():
    """momentum=None (torch.fx calls the BatchNorm modules): the cumulative average over every micro-batch."""
    check("bn-mlp-cumulative", "1f1b")


def test_a_counter_buffer_counts_every_replicas_forwards():
    check("counted", "1f1b")


@pytest.mark.slow
def test_a_batch_norm_called_twice_in_a_stage_updates_twice_in_order():
    check("shared-norm", "1f1b")


@pytest.mark.parametrize("replicas", [pytest.param([2, 2], marks=pytest.mark.slow), [1, 1]])
def test_recomputed_forwards_update_statistics_once(replicas):
    """Recomputation reruns the forward inside the backward: before, BatchNorm counted every
    micro-batch twice there (num_batches_tracked 24 instead of 12), replicated or not."""
    check("bn-mlp", "1f1b", recompute=True, replicas=replicas)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_replicated_chunks_of_virtual_stages(schedule):
    """Each rank holds two model chunks with their own batch norms; each chunk's replicas combine them."""
    check("bn-mlp", schedule, virtual_stages=2, cuts=[2, 4, 7])


def test_pipedream_keeps_replicas_identical_and_counts_every_micro_batch():
    """No flush, weights of different ages: the statistics of each micro-batch counted once, in order,
    on every replica (the weights themselves follow PipeDream's asynchronous updates)."""
    plan = make_plan(BN_MLP, [4], [2, 1], schedule="pipedream", micro_batches=4, batch_size=4, shared_capture=True)
    seen = pipelined(plan, STEPS)          # the harness asserts bitwise-equal replicas at the end
    for (rank, step), state in seen.items():
        for name, value in state.items():
            if name.endswith("num_batches_tracked"):
                assert int(value) == 4 * (step + 1) or rank == 2, (rank, step, name, value)   # stage 1: lags
    assert torch.equal(seen[0, STEPS - 1]["1.running_var"], seen[1, STEPS - 1]["1.running_var"])


def test_writes_are_classified():
    kinds = {w.buffer: w.kind for w in buffer_writes(capture(resolve_model(BN_MLP)).graph)}
    assert kinds == {"1.num_batches_tracked": COUNTER, "1.running_mean": BATCH_NORM, "1.running_var": BATCH_NORM,
                     "4.num_batches_tracked": COUNTER, "4.running_mean": BATCH_NORM, "4.running_var": BATCH_NORM,
                     "7.num_batches_tracked": COUNTER, "7.running_mean": BATCH_NORM, "7.running_var": BATCH_NORM}
    smoothed = buffer_writes(capture(resolve_model("tests.pipeline.bn_models:smoothed")).graph)
    assert [(w.buffer, w.kind) for w in smoothed] == [("ema", OTHER)]       # under torch.no_grad(): a subgraph


def test_an_uncombinable_buffer_on_a_replicated_stage_is_refused_at_start_up():
    plan = make_plan("tests.pipeline.bn_models:smoothed", [0], [1, 2], shared_capture=True)
    with pytest.raises(UserError, match=r"stage 1 has 2 replicas .* buffer 'ema' .*re-partition"):
        train_pipeline(plan, 1, shared_capture=True)


def test_an_uncombinable_buffer_on_an_unreplicated_stage_trains():
    plan = make_plan("tests.pipeline.bn_models:smoothed", [0], [2, 1], shared_capture=True)
    merged, _ = train_pipeline(plan, 1, shared_capture=True)
    assert float(merged["ema"].abs().sum()) > 0


def test_a_buffer_changed_inside_a_leaf_module_of_a_replicated_stage_is_refused():
    """torch.fx cannot see into a leaf module: the first forward shows the change."""
    plan = make_plan("tests.pipeline.bn_models:tallied[leaf=Tally]", [1], [2, 1], shared_capture=True)
    with pytest.raises(UserError, match=r"stage 0 has 2 replicas .* buffer 'tally.positive'"):
        train_pipeline(plan, 1, shared_capture=True)


def test_a_buffer_written_by_one_stage_and_used_by_another_is_refused():
    plan = make_plan("tests.pipeline.bn_models:shared_norm", [1], [1, 1], shared_capture=True)
    with pytest.raises(UserError, match=r"buffer 'norm\.[a-z_]+' is changed .* stages 0 and 1"):
        train_pipeline(plan, 1, shared_capture=True)


def test_recompute_refuses_an_uncombinable_write():
    plan = make_plan("tests.pipeline.bn_models:smoothed", [0], [1, 1], shared_capture=True)
    plan = dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], recompute=True)))
    with pytest.raises(UserError, match="recomputes its forward .* 'ema'"):
        train_pipeline(plan, 1, shared_capture=True)
