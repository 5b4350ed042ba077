"""The Step's 1/M in the last stage's backward seed (pipeline/loss_seed.py).

Where the factor is a power of two, the Step runs no pass over the gradients and every rank's
gradients equal, bit for bit, those of a plain loop that backpropagates each micro-batch's mean
loss / M (gradient accumulation); elsewhere the Step scales as before."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessNetwork, run_ranks
from hybridpipe.pipeline.loss_seed import loss_seed
from hybridpipe.pipeline.plancheck import build_stage
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture, data_for, make_plan, model_loss


def test_the_seed_is_the_factor_only_where_it_is_exact():
    flushed, pipedream = get_schedule("1f1b"), get_schedule("pipedream")
    plain = {"tokens": False, "loss_scale": False, "autocast": None}
    assert loss_seed(8, flushed, **plain) == 0.125
    assert loss_seed(1, flushed, **plain) == 1.0
    assert loss_seed(4, flushed, **{**plain, "autocast": torch.bfloat16}) == 0.25
    assert loss_seed(6, flushed, **plain) is None                    # 1/6 is rounded: the Step scales
    assert loss_seed(8, pipedream, **plain) is None                  # a step per micro-batch, 1/r per stage
    assert loss_seed(8, flushed, **{**plain, "tokens": True}) is None        # 1/tokens, known at the Step
    assert loss_seed(8, flushed, **{**plain, "loss_scale": True}) == 0.125   # GradScaler's scale(loss / M)
    assert loss_seed(6, flushed, **{**plain, "loss_scale": True, "autocast": torch.float16}) == 1 / 6
    assert loss_seed(8, pipedream, **{**plain, "loss_scale": True}) is None
    assert loss_seed(8, flushed, **{**plain, "autocast": torch.float16}) is None


class Ops(TorchDispatchMode):
    """The aten ops dispatched inside it (this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_step_scales_nothing_and_gradients_equal_a_plain_loop_bitwise(schedule):
    M = 4
    plan = make_plan("mlp", [2, 5], [1, 1, 1], schedule=schedule, micro_batches=M, batch_size=4)
    spec, topo = resolve_model(plan.model), Topology.from_plan(plan)
    network = InProcessNetwork(timeout=30)

    def rank_fn(rank: int):
        stage = build_stage(capture(spec, plan.batch_size), plan, rank, loss=spec.loss)
        grads: dict[str, torch.Tensor] = {}

        def before_step() -> bool:      # the gradients the optimizer steps with (keys: the model's names)
            grads.update({n: p.grad.clone() for n, p in stage.module.named_parameters()})
            return True
        engine = PipelineEngine(stage, topo, rank, get_schedule(schedule), transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.5),
                                data=data_for(plan, 1), before_step=before_step)
        step_level, ops = engine._execute_step_level, Ops()

        def counted(ins, result):
            with ops:
                step_level(ins, result)
        engine._execute_step_level = counted        # type: ignore[method-assign]
        return lambda: (engine.run_step(0), grads, ops.seen)[1:]

    got = run_ranks({r: rank_fn(r) for r in range(plan.world_size)}, network)
    for rank, (_, ops) in got.items():
        assert not [op for op in ops if "mul" in op or "div" in op], (rank, ops)     # before: _foreach_mul_
    torch.manual_seed(0)
    model = spec.build()
    data = data_for(plan, 1)
    for m in range(M):
        x, y = data.batch(0, m)
        (model_loss(spec, model, x, y) / M).backward()
    plain = dict(model.named_parameters())
    ours = {name: g for grads, _ in got.values() for name, g in grads.items()}
    assert sorted(ours) == sorted(plain)
    for name, g in ours.items():
        assert torch.equal(g, plain[name].grad), name
