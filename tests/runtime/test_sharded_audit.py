"""Sharded replicas (ZeRO-1/2/3) with what the other tests do not combine them with: GPT-2's tied
embedding cut apart between sharded stages under global-norm clipping, against a plain loop with
torch.nn.utils.clip_grad_norm_ over the unsplit model (the tied weight counted once). (fp16's forced
overflow on sharded stages: test_hf_launch.py; evaluation and clipping at every level:
test_launch_training_options.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, model_loss
from tests.pipeline.hf_models import BY_NAME, GPT2
from tests.runtime.jobs import data_for, final_weights, launch, max_diff

pytest.importorskip("transformers")

STEPS, LR, MOMENTUM, SEED, CLIP = 3, 0.05, 0.5, 3, 0.05


def clipped_reference(plan) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: SGD with momentum, each step's gradients clipped to CLIP by their global norm."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = data_for(plan, STEPS, SEED)
    norms = []
    for k in range(STEPS):
        opt.zero_grad()
        model_loss(spec, model, *data.global_batch(k)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return model.state_dict(), norms


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "parameters"])
def test_clipping_a_tied_weight_cut_between_sharded_stages_equals_one_process(tmp_path, shard):
    case = BY_NAME["gpt2"]
    plan = make_plan(GPT2, case.two, [2, 2], schedule="1f1b", micro_batches=4, batch_size=2, shared_capture=True)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages))
    assert plan.tied
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--lr", str(LR), "--momentum",
                   str(MOMENTUM), "--seed", str(SEED), "--clip-grad-norm", str(CLIP), "--checkpoint-dir",
                   str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run"), "--timeout", "120", "--no-progress",
                   "--no-trace"], plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    weights, norms = clipped_reference(plan)
    assert min(norms) > 10 * CLIP                                    # every step clipped
    assert max_diff(final_weights(tmp_path / "ck", STEPS), weights) <= 1e-5
