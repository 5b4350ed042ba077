"""``--optimizer adamw`` (issue 28 item 8): decoupled weight decay, as torch.optim.AdamW, through
launch (2 stages x 2 replicas) equal to a plain single-process AdamW loop, and not what ``adam``
(L2 weight decay) trains; the partitioner prices its state like Adam's."""

from __future__ import annotations

import dataclasses

import torch

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.config import build_parser
from hybridpipe.runtime.parts import make_optimizer
from tests.partitioner.synth import flat_cluster, make_profile
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import data_for, final_weights, launch, max_diff

STEPS, LR, WD, SEED = 4, 0.01, 0.1, 5


def plain_loop(plan, optimizer: type[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """The unsplit model in one process, each step's whole global batch, ``optimizer`` as torch has it."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = optimizer(model.parameters(), lr=LR, weight_decay=WD)
    data = data_for(plan, STEPS, SEED)
    for k in range(STEPS):
        opt.zero_grad()
        model_loss(spec, model, *data.global_batch(k)).backward()
        opt.step()
    return model.state_dict()


def test_launch_adamw_equals_a_plain_adamw_loop_and_differs_from_adam(tmp_path):
    plan = make_plan("mlp", [3], [2, 2], schedule="1f1b", micro_batches=4, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--optimizer", "adamw",
                   "--lr", str(LR), "--weight-decay", str(WD), "--seed", str(SEED),
                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
                   "--timeout", "60", "--no-progress", "--no-trace"], plan.world_size, timeout=150)
    assert all(d.returncode == 0 for d in done), done
    trained = final_weights(tmp_path / "ckpt", STEPS)
    # Adam's g / sqrt(v) turns the rounding of summing 4 micro-batches' gradients (instead of one
    # batch's) into ~1e-5 where gradients are near zero; Adam's L2 decay lands ~8e-2 away
    assert max_diff(trained, plain_loop(plan, torch.optim.AdamW)) <= 1e-4
    assert max_diff(trained, plain_loop(plan, torch.optim.Adam)) > 1e-2


def test_each_optimizer_name_is_torchs_and_help_says_which():
    w = torch.nn.Parameter(torch.ones(2))
    assert type(make_optimizer("adamw", [w], lr=0.1, weight_decay=0.1)) is torch.optim.AdamW
    assert type(make_optimizer("adam", [w], lr=0.1, weight_decay=0.1)) is torch.optim.Adam
    assert make_optimizer("adamw", [w], lr=0.1, weight_decay=0.1).param_groups[0]["weight_decay"] == 0.1
    text = " ".join(build_parser().format_help().split())
    assert "adamw: torch.optim.AdamW" in text and "decoupled" in text and "L2" in text


def test_partition_prices_adamw_as_adam():
    profile = make_profile([(2.0, 4.0, 1_000_000, 4_000_000), (1.0, 2.0, 500_000, 12_000_000)])
    profile = dataclasses.replace(profile, totals=dataclasses.replace(profile.totals, sgd_step_ms=1.0,
                                                                      adam_step_ms=3.0))
    costs = model_costs(profile)
    assert (costs.optimizer_ms("adamw") == costs.optimizer_ms("adam")).all() and costs.optimizer_ms("adam").sum() > 0
    model = CostModel(flat_cluster(2, gbps=10.0))
    stages = (StageSpec(0, 1, (0,)), StageSpec(2, 3, (1,)))
    adam, adamw, sgd = (evaluate(costs, model, stages, Options(get_schedule("1f1b"), 4, k))
                        for k in ("adam", "adamw", "sgd"))
    assert [s.memory_bytes for s in adamw.stages] == [s.memory_bytes for s in adam.stages]
    assert [s.overhead_ms for s in adamw.stages] == [s.overhead_ms for s in adam.stages]
    assert all(a.memory_bytes > s.memory_bytes for a, s in zip(adamw.stages, sgd.stages, strict=True))
