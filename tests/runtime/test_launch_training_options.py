"""launch's --lr-schedule / --warmup-steps / --clip-grad-norm: the run equals a plain PyTorch loop
with the same LambdaLR, weight decay and clip_grad_norm_; pipedream refuses clipping in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.config import build_parser, resolve
from hybridpipe.runtime.lr import lr_schedule
from hybridpipe.runtime.metrics import metrics_path, read_metrics
from hybridpipe.runtime.parts import held_out_seed
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import data_for, final_weights, launch, max_diff

STEPS, LR, MOMENTUM, WD, SEED, CLIP, WARMUP = 5, 0.05, 0.5, 0.01, 3, 0.1, 2


def held_out_losses(model, spec, plan, batches: int) -> float:
    data = MicroBatches(resolve_dataset("synthetic", spec, size=batches * plan.micro_batches * plan.batch_size,
                                        seed=held_out_seed(SEED)), plan.batch_size, plan.micro_batches)
    model.eval()
    with torch.no_grad():
        loss = sum(float(model_loss(spec, model, *data.global_batch(j))) for j in range(batches)) / batches
    model.train()
    return loss


def reference(plan):
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    sched = lr_schedule("cosine", warmup=WARMUP, total=STEPS)(opt)
    data = data_for(plan, STEPS, SEED)
    lrs, norms, evals = [], [], {-1: held_out_losses(model, spec, plan, 2)}
    for k in range(STEPS):
        opt.zero_grad()
        model_loss(spec, model, *data.global_batch(k)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if (k + 1) % 2 == 0 or k == STEPS - 1:
            evals[k] = held_out_losses(model, spec, plan, 2)
    return model.state_dict(), lrs, norms, evals


@pytest.mark.parametrize("shard", ["none", *(pytest.param(s, marks=pytest.mark.slow)
                                              for s in ("optimizer", "gradients", "parameters"))])
def test_launch_with_cosine_warmup_clipping_and_weight_decay_matches_plain_pytorch(tmp_path, shard):
    """On 2 x 2, the replicas plain or sharded (ZeRO-1/2/3: the held-out evaluation gathers ZeRO-3's
    weights, clipping's norm sums the owned pieces)."""
    plan = make_plan("mlp", [3], [2, 2], schedule="gpipe", micro_batches=4, batch_size=4)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    done = launch(["--plan", str(path), "--steps", str(STEPS), "--lr", str(LR), "--momentum", str(MOMENTUM),
                   "--weight-decay", str(WD), "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP),
                   "--clip-grad-norm", str(CLIP), "--eval-every", "2", "--eval-batches", "2",
                   "--seed", str(SEED), "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--run-dir", str(tmp_path / "run"), "--timeout", "60", "--no-progress", "--no-trace"],
                  plan.world_size, timeout=150)
    assert all(d.returncode == 0 for d in done), done
    weights, lrs, norms, evals = reference(plan)
    assert min(norms) > CLIP
    assert max_diff(final_weights(tmp_path / "ckpt", STEPS), weights) <= 1e-5
    records = [r for r in read_metrics(metrics_path(tmp_path / "run", 3)) if r["step"] >= 0]
    assert [r["lr"] for r in records] == pytest.approx(lrs)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)
    for rank in range(plan.world_size):                     # held-out loss on every rank: before, after 2, 4, 5 steps
        lines = read_metrics(metrics_path(tmp_path / "run", rank))
        got = {r["step"]: r["eval_loss"] for r in lines if "eval_loss" in r}
        assert got == pytest.approx(evals, abs=1e-5)


def test_clipping_is_refused_for_pipedream(tmp_path):
    plan = make_plan("mlp", [3], [1, 1], schedule="pipedream", micro_batches=2, batch_size=4)
    save_plan(plan, tmp_path / "plan.json")
    args = build_parser().parse_args(["--plan", str(tmp_path / "plan.json"), "--clip-grad-norm", "1",
                                      "--run-dir", str(tmp_path / "run")])
    with pytest.raises(UserError, match=r"clip_grad_norm \(--clip-grad-norm\) needs a global step"):
        resolve(args, 2)


def test_launch_runs_the_plans_precision_unless_told_otherwise(tmp_path):
    """A plan priced for bf16 (`partition --precision bf16`) runs in bf16, its replicas summing in the
    plan's reduce dtype; --precision and --reduce-dtype override them."""
    plan = dataclasses.replace(make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4), precision="bf16")
    save_plan(plan, tmp_path / "plan.json")
    base = ["--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run")]
    assert resolve(build_parser().parse_args(base), 2).training.precision == "bf16"
    assert resolve(build_parser().parse_args(base + ["--precision", "fp32"]), 2).training.precision == "fp32"
    assert resolve(build_parser().parse_args(base), 2).training.reduce_dtype == "fp32"           # as DDP under autocast
    assert resolve(build_parser().parse_args(base + ["--reduce-dtype", "bf16"]), 2).training.reduce_dtype == "bf16"
    low = dataclasses.replace(plan, reduce_dtype="bf16")       # `partition --reduce-dtype bf16` priced it so
    save_plan(low, tmp_path / "plan.json")
    assert resolve(build_parser().parse_args(base), 2).training.reduce_dtype == "bf16"
    assert resolve(build_parser().parse_args(base + ["--reduce-dtype", "fp32"]), 2).training.reduce_dtype == "fp32"


def test_a_model_captured_for_another_precision_is_refused_in_one_line(tmp_path):
    """The Trainer's graph must be captured under the autocast it runs in (a float32 capture stops at
    torch.export's dtype checks at the first forward): refused before any process group forms."""
    from hybridpipe.runtime.parts import build_model
    from hybridpipe.runtime.trainer import Trainer

    plan = make_plan("mlp", [3], [1, 1], micro_batches=2, batch_size=4)
    model = build_model(resolve_model("mlp"), plan, seed=0)
    with pytest.raises(UserError, match="captured for fp32 but the trainer runs bf16"):
        Trainer(model, plan, precision="bf16")
    with pytest.raises(UserError, match="unknown reduce_dtype"):
        Trainer(model, plan, reduce_dtype="fp8")
