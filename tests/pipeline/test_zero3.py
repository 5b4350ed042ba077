"""Sharded weights (ZeRO-3, ``shard: parameters``) inside pipeline stages: training equals a plain
single-process loop written in test_sharded.py (weights and buffers, 1e-5 in float32) for the flushing
schedules, SGD with momentum and AdamW, a tied GPT-2 and a tied Llama, gathered weights freed after each
forward or kept over the step; bit for bit the ZeRO-2 run (the same reduce-scatters, the same update);
each replica holds 1/R of the weights, and the meter's peak is the planner's formula; checkpoints move
between ZeRO-3 and replicated plans bit for bit."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.partitioner.search.sharding import Variant, static_bytes
from hybridpipe.pipeline.memory import optimizer_tensors, tensors_bytes
from tests.pipeline.harness import data_for, make_plan
from tests.pipeline.hf_models import GPT2
from tests.pipeline.sharded_harness import sharded, train_sharded
from tests.pipeline.test_sharded import LAYOUTS, MODELS, OPTIMIZERS, STEPS, check_equal, plain_loop, the_plan


def run_case(model: str, schedule: str, optimizer: str, reshard: bool, **kw) -> dict:
    plan = sharded(the_plan(model, schedule, "parameters"), "parameters", reshard)
    runs = train_sharded(plan, STEPS, OPTIMIZERS[optimizer], **kw)
    check_equal(plan, runs, plain_loop(plan, OPTIMIZERS[optimizer]))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule,optimizer,reshard", [
    ("gpt2", "1f1b", "adamw", True),
    ("llama", "zb-h1", "sgd", False),
])
def test_zero3_training_equals_a_plain_loop(model, schedule, optimizer, reshard):
    run_case(model, schedule, optimizer, reshard)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_matrix_equals_a_plain_loop(model, schedule, optimizer, reshard):
    run_case(model, schedule, optimizer, reshard)


@pytest.mark.slow
def test_zero3_with_recomputation_and_a_bf16_wire():
    """A recomputing stage's rerun gathers through the same gates; gradients reduce-scattered in
    bfloat16 stay within bfloat16's rounding of the float32 loop."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=4, recompute=True)
    for reshard in (True, False):
        plan = sharded(base, "parameters", reshard)
        check_equal(plan, train_sharded(plan, STEPS, OPTIMIZERS["adamw"]), plain_loop(base, OPTIMIZERS["adamw"]))
    runs = train_sharded(sharded(base, "parameters"), STEPS, OPTIMIZERS["sgd"], wire_dtype=torch.bfloat16)
    reference = plain_loop(base, OPTIMIZERS["sgd"])
    worst = max(float((v - reference[k if k in reference else k.split(".", 1)[-1]]).abs().max())
                for run in runs.values() for k, v in run["state"].items())
    assert 0 < worst < 1e-4


def test_zero3_holds_its_share_of_the_weights_and_the_meter_counts_the_planners_formula():
    """Per rank: the sharded weights' storages are empty between steps, the owned pieces 1/R of them
    (within one unit); the meter's peak is ZeRO-2's less the weights sharding frees plus the gathered
    working set, which is at most the two largest units with resharding after forward (the planner's
    static_bytes, within 5%) and the whole weights plus the gradient being reduce-scattered without (also
    static_bytes, within 5%);
    the training equals ZeRO-2's bit for bit; evaluation runs on gathered weights (ZeRO-2's losses).
    ZeRO-2's step queues the updated weights' all-gathers and returns: the next forward's gates wait."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=4)
    make = OPTIMIZERS["adamw"]
    evals: dict[str, dict] = {}
    peaks: dict[tuple[str, int], int] = {}
    queued: list[int] = []

    def observe(name: str):
        def at(rank: int, step: int, engine) -> None:
            for sync in engine.syncs.values():
                if name == "zero2" and getattr(sync, "gates", None) is not None:   # gathers queued, none waited yet
                    queued.append(len(sync.gates._handles))
                if getattr(sync, "weights", None) is not None:      # the step's, before close() gathers them all
                    peaks[name, rank] = sync.peak_transient
                    assert all(p.untyped_storage().nbytes() == 0 for ps in sync.weights.params for p in ps)
            if step == 1:
                evals.setdefault(name, {}).update(engine.run_eval(data_for(base, 1)))
        return at
    variants = {"zero2": ("gradients", True), "reshard": ("parameters", True), "keep": ("parameters", False)}
    runs = {name: train_sharded(sharded(base, level, reshard), 2, make, observe=observe(name), overlap_gather=True)
            for name, (level, reshard) in variants.items()}
    assert queued and all(n > 0 for n in queued)        # ZeRO-2's gathers overlap the next forward
    assert evals["zero2"] and all(torch.equal(v, evals["reshard"][m]) and torch.equal(v, evals["keep"][m])
                                  for m, v in evals["zero2"].items())
    for r, zero2 in runs["zero2"].items():
        for name in ("reshard", "keep"):
            run = runs[name][r]
            assert all(torch.equal(v, run["state"][k]) for k, v in zero2["state"].items()), (name, r)
            sync = next(s for s in run["engine"].syncs.values() if getattr(s, "weights", None) is not None)
            units = sorted(sync.weights.nbytes, reverse=True)
            weights, owned = sum(units), sum(t.numel() * 4 for ts in sync.weights.owned for t in ts)
            assert abs(owned - weights / 2) <= units[0]
            tied = sum(p.numel() * 4 for p in run["module"].parameters() if all(p is not q for q in sync.sharded))
            transient = peaks[name, r]
            assert name == "reshard" or transient <= weights + units[0]
            # the meter: ZeRO-2's peak less the full weights (now owned pieces) and ZeRO-2's gradient term,
            # plus ZeRO-3's gathered weights and gradients in flight (the same activations)
            zero2_sync = next(s for s in zero2["engine"].syncs.values() if hasattr(s, "full_grad_bytes"))
            owned_grads = sum((pc.hi - pc.lo) * 4 for pc in sync.pieces())
            expected = (zero2["results"][-1].peak_memory_bytes - weights + owned
                        - zero2_sync.full_grad_bytes() + owned_grads + transient)
            assert run["results"][-1].peak_memory_bytes == expected, name
            state = tensors_bytes(optimizer_tensors(run["optimizer"]))
            measured = owned + owned_grads + transient + state + 2 * tied     # tied: whole weight and gradient
            predicted = static_bytes(Variant("parameters", name == "reshard"), weights, 2, 2, units[0],
                                     units[0] + units[1]) + 4 * tied
            assert abs(measured - predicted) <= 0.05 * predicted, (name, measured, predicted)


def test_zero3_checkpoints_move_to_and_from_replicated_bit_identically():
    """A ZeRO-3 run's gathered state resumes replicated, and the reverse, continuing bit for bit as the
    uninterrupted run of the new plan (one micro-batch per replica: the reduce-scatter sums what the
    all-reduce sums, so the levels agree bitwise)."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=2)
    make = OPTIMIZERS["adamw"]
    whole = train_sharded(base, 4, make)
    for a, b in ((sharded(base, "parameters"), base), (base, sharded(base, "parameters", False))):
        first = train_sharded(a, 2, make, total=4)
        start = {r: (run["state"], run["full_optimizer_state"]) for r, run in first.items()}
        runs = train_sharded(b, 2, make, first=2, start=start, total=4)
        for r, run in runs.items():
            assert all(torch.equal(run["state"][k], v) for k, v in whole[r]["state"].items()), r
            full = run["full_optimizer_state"]["state"]
            assert all(torch.equal(full[i]["exp_avg_sq"], s["exp_avg_sq"])
                       for i, s in whole[r]["full_optimizer_state"]["state"].items())

