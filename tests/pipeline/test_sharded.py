"""Sharded replicas (ZeRO-1 ``optimizer``, ZeRO-2 ``gradients``) inside pipeline stages: training equals
a plain single-process loop written here (weights and buffers, 1e-5 in float32) on a tied GPT-2 and a
tied Llama, for the synchronous schedules and SGD with momentum / AdamW; each replica holds 1/R of
the optimizer state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.pipeline.memory import optimizer_tensors, tensors_bytes
from hybridpipe.pipeline.simulator import simulate
from hybridpipe.profiles.capture import call_args, training_switches
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo import resolve_model
from tests.partitioner.synth import flat_cluster
from tests.pipeline.harness import data_for, make_plan
from tests.pipeline.hf_models import GPT2, LLAMA
from tests.pipeline.sharded_harness import sharded, train_sharded

STEPS = 3
LR = 0.01
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR / 10, weight_decay=0.1),
}
# schedule -> (cuts of the GPT-2 / the Llama, replicas per rank group, virtual stages)
LAYOUTS = {
    "gpipe": ({"gpt2": [3], "llama": [2]}, [2, 2], 1),
    "1f1b": ({"gpt2": [3], "llama": [2]}, [2, 2], 1),
    "zb-h1": ({"gpt2": [3], "llama": [2]}, [2, 2], 1),
    "interleaved-1f1b": ({"gpt2": [0, 3, 4], "llama": [1, 2, 3]}, [2, 2], 2),
    "zbv": ({"gpt2": [0, 3, 4], "llama": [1, 2, 3]}, [2, 2], 2),
}
MODELS = {"gpt2": GPT2, "llama": LLAMA}


def plain_loop(plan: Plan, make, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single-process training: each step, every micro-batch's mean loss / M backpropagated, one step."""
    spec = resolve_model(plan.model)
    torch.manual_seed(0)
    model = spec.build()
    opt = make(list(model.parameters()))
    data = data_for(plan, steps)
    for k in range(steps):
        opt.zero_grad()
        for m in range(plan.micro_batches):
            x, y = data.batch(k, m)
            args, kwargs = call_args(x)
            out = model(*args, **kwargs, **training_switches(model))
            loss = spec.loss(out, y) if spec.loss is not None else out.loss
            (loss / plan.micro_batches).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def the_plan(model: str, schedule: str, level: str, micro_batches: int = 4) -> Plan:
    cuts, replicas, virtual = LAYOUTS[schedule]
    return sharded(make_plan(MODELS[model], cuts[model], replicas, schedule=schedule, micro_batches=micro_batches,
                             virtual_stages=virtual), level)


def check_equal(plan: Plan, runs: dict, reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for s in plan.stages:
        states = [runs[r]["state"] for r in s.ranks]
        for other in states[1:]:
            assert all(torch.equal(states[0][k], other[k]) for k in states[0]), f"replicas of stage {s.index} differ"
    for run in runs.values():
        for name, value in run["state"].items():
            canonical = name if name in reference else name.split(".", 1)[-1]
            assert canonical in reference, name
            worst = max(worst, float((value - reference[canonical]).abs().max()))
    assert worst < 1e-5, worst
    return worst


def run_case(model: str, schedule: str, level: str, optimizer: str) -> None:
    plan = the_plan(model, schedule, level)
    runs = train_sharded(plan, STEPS, OPTIMIZERS[optimizer])
    check_equal(plan, runs, plain_loop(plan, OPTIMIZERS[optimizer]))


@pytest.mark.parametrize("model,schedule,level,optimizer", [
    ("gpt2", "1f1b", "optimizer", "adamw"),
    ("llama", "zb-h1", "gradients", "sgd"),
])
def test_sharded_training_equals_a_plain_loop(model, schedule, level, optimizer):
    run_case(model, schedule, level, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
@pytest.mark.parametrize("level", ["optimizer", "gradients"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sharded_matrix_equals_a_plain_loop(model, schedule, level, optimizer):
    run_case(model, schedule, level, optimizer)


def resumed(plan_a: Plan, plan_b: Plan, make, steps: int = 2) -> dict[int, dict]:
    """``steps`` steps of ``plan_a``, its whole state (weights, optimizer: gathered if sharded) handed to
    ``plan_b`` as a checkpoint would, ``steps`` more steps of ``plan_b``."""
    first = train_sharded(plan_a, steps, make, total=2 * steps)
    start = {r: (run["state"], run["full_optimizer_state"]) for r, run in first.items()}
    return train_sharded(plan_b, steps, make, first=steps, start=start, total=2 * steps)


def test_checkpoint_state_moves_between_shard_levels_bit_identically():
    """A replicated run's state resumes sharded and a sharded run's replicated, continuing bit for bit
    as the uninterrupted run (two replicas sum in one order whatever the algorithm: ZeRO-1 = replicated
    bitwise); ZeRO-2's state resumes ZeRO-2 bit for bit too."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=4)
    make = OPTIMIZERS["adamw"]
    replicated = train_sharded(base, 4, make)
    for a, b in (("none", "optimizer"), ("optimizer", "none")):
        runs = resumed(sharded(base, a), sharded(base, b), make)
        for r, run in runs.items():
            assert all(torch.equal(run["state"][k], v) for k, v in replicated[r]["state"].items()), (a, b, r)
    zero2 = train_sharded(sharded(base, "gradients"), 4, make)
    runs = resumed(sharded(base, "gradients"), sharded(base, "gradients"), make)
    for r, run in runs.items():
        assert all(torch.equal(run["state"][k], v) for k, v in zero2[r]["state"].items()), r
        full = run["full_optimizer_state"]["state"]
        assert all(torch.equal(full[i]["exp_avg"], s["exp_avg"]) for i, s in
                   zero2[r]["full_optimizer_state"]["state"].items())


def test_each_replica_holds_its_share_of_the_state_and_the_meter_counts_it():
    """Optimizer-state bytes per rank = 1/R of the replicated plan's within one layer (the tied
    embedding stays whole); the meter's peak moves by exactly the state and gradients sharding frees
    (ZeRO-1: O - O/R; ZeRO-2 also G - G/R less the full gradients in flight); evaluation afterwards
    sees the gathered weights (ZeRO-1's losses = replicated's bit for bit)."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=4)
    make = OPTIMIZERS["adamw"]
    evals: dict[str, dict] = {}

    def evaluate(level: str):
        def observe(rank: int, step: int, engine) -> None:       # evaluation after the last step, on every rank
            if step == 1:
                evals.setdefault(level, {}).update(engine.run_eval(data_for(base, 1)))
        return observe
    runs = {level: train_sharded(sharded(base, level), 2, make, observe=evaluate(level))
            for level in ("none", "optimizer", "gradients")}
    assert evals["none"] and all(torch.equal(v, evals["optimizer"][m]) for m, v in evals["none"].items())
    assert all(abs(float(v) - float(evals["gradients"][m])) < 1e-5 for m, v in evals["none"].items())

    def state_bytes(run) -> int:
        return sum(t.numel() * t.element_size() for st in run["optimizer"].state.values()
                   for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    for r in runs["none"]:
        replicated, zero1, zero2 = (runs[level][r] for level in ("none", "optimizer", "gradients"))
        module = replicated["module"]
        largest = max(2 * p.numel() * 4 for p in module.parameters())     # AdamW: two moments per element
        assert abs(state_bytes(zero1) - state_bytes(replicated) / 2) <= largest
        assert state_bytes(zero1) == state_bytes(zero2)
        peaks = [run["results"][-1].peak_memory_bytes for run in (replicated, zero1, zero2)]
        held = [tensors_bytes(optimizer_tensors(run["optimizer"])) for run in (replicated, zero1)]   # 'step's too
        assert peaks[0] - peaks[1] == held[0] - held[1]
        shards = [s for s in zero2["engine"].syncs.values() if hasattr(s, "full_grad_bytes")]
        sharded_grads = sum(p.numel() * 4 for s in shards for p in s.sharded)
        assert peaks[1] - peaks[2] == sharded_grads - sum(s.full_grad_bytes() for s in shards)
        for s in shards:        # at most the largest unit's full gradient in flight (the contract with the planner)
            largest_unit = max(sum(p.numel() * 4 for p in u.unit.params) for u in s.units)
            owned = sum((pc.hi - pc.lo) * 4 for pc in s.pieces())
            assert s.peak_inflight <= largest_unit and s.full_grad_bytes() == owned + largest_unit


@pytest.mark.slow
def test_zero2_with_recomputation_and_a_bf16_wire():
    """Recomputing stages shard as they are; gradients reduce-scattered in bfloat16 stay within
    bfloat16's rounding of the float32 loop."""
    base = make_plan(GPT2, [3], [2, 2], schedule="1f1b", micro_batches=4, recompute=True)
    check_equal(base, train_sharded(sharded(base, "gradients"), STEPS, OPTIMIZERS["adamw"]),
                plain_loop(base, OPTIMIZERS["adamw"]))
    runs = train_sharded(sharded(base, "gradients"), STEPS, OPTIMIZERS["sgd"], wire_dtype=torch.bfloat16)
    reference = plain_loop(base, OPTIMIZERS["sgd"])
    worst = max(float((v - reference[k if k in reference else k.split(".", 1)[-1]]).abs().max())
                for run in runs.values() for k, v in run["state"].items())
    assert 0 < worst < 1e-4


@pytest.mark.slow
def test_a_planned_interleaved_sharded_plan_trains_as_a_plain_loop():
    """`partition --schedule interleaved-1f1b --virtual-stages 2 --shard auto` on the profiled tied GPT-2,
    with less memory than the replicated chunks need: the planned levels (ZeRO-1/2 per chunk) run in
    process and equal the plain loop."""
    profile = profile_model(resolve_model(GPT2), batch_size=4, repeats=1, warmup=0, progress=False)
    req = Request(optimizer="adamw", micro_batches=4, strategy="uniform", stages=2, schedule="interleaved-1f1b",
                  virtual_stages=2)
    replicated = partition(profile, flat_cluster(4), req, simulate=lambda p: simulate(p).step_ms).plan
    need = max(s.memory_bytes for s in replicated.stages)
    plan = partition(profile, flat_cluster(4, memory_gb=need * 0.9 / 1e9), dataclasses.replace(req, shard="auto"),
                     simulate=lambda p: simulate(p).step_ms).plan
    assert plan.virtual_stages == 2 and {s.shard for s in plan.stages} - {"none"}
    assert all(s.shard == "none" for s in replicated.stages)
    check_equal(plan, train_sharded(plan, STEPS, OPTIMIZERS["adamw"]), plain_loop(plan, OPTIMIZERS["adamw"]))
