"""Audit: the Trainer with optimizer features of a plain PyTorch loop, on real rank processes (gloo),
against that loop written here or against itself uninterrupted.

* AdamW in two parameter groups (matrices decayed at one learning rate, vectors undecayed at another)
  under OneCycleLR, which moves Adam's beta1 along with the learning rate every step (the README's
  own example scheduler), saved after 3 of 6 steps and resumed.
"""

from __future__ import annotations

from pathlib import Path

import torch

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.audit_ranks import SEED, STEPS, grouped_adamw, one_cycle
from tests.runtime.jobs import data_for, final_weights, max_diff
from tests.runtime.rank_procs import Job

RANKS = Path(__file__).with_name("audit_ranks.py")


def run(plan, calls: list, timeout: float = 240) -> list[list]:
    with Job(RANKS, "in_turn", plan.world_size, (calls,)) as job:
        results = job.wait(timeout=timeout)
    assert all(r.returncode == 0 for r in results), results
    return [r.value for r in results]


CLIP = 0.1


def reference(plan) -> tuple[dict, list[float], list[list]]:
    """The unsplit model in one process: the same groups, scheduler and clipping; weights, losses and
    each step's hyperparameters."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = grouped_adamw(list(model.parameters()))
    sched = one_cycle(opt)
    data = data_for(plan, STEPS, SEED)
    losses, hypers, norms = [], [], []
    for k in range(STEPS):
        hypers.append([[g["lr"], g["betas"][0], g["weight_decay"]] for g in opt.param_groups])
        opt.zero_grad()
        loss = model_loss(spec, model, *data.global_batch(k))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        losses.append(float(loss))
    assert min(norms) > 2 * CLIP                # the clipping acts on every step
    return model.state_dict(), losses, hypers


@pytest.mark.slow
def test_grouped_adamw_under_one_cycle_equals_one_process_and_resumes_bitwise(tmp_path):
    """Before the fix a resumed run took its first step with OneCycleLR's step-0 beta1 (0.95 instead of
    0.875: the checkpoint's hyperparameters were dropped for the new optimizer's) and ended 2.0e-2 from
    the uninterrupted run after 3 more steps (mlp, 2 stages)."""
    plan = make_plan("mlp", [3], [2, 2], schedule="1f1b", micro_batches=4, batch_size=2)
    weights, losses, hypers = reference(plan)
    path = str(save_plan(plan, tmp_path / "plan.json"))
    calls = [["resume_one_cycle", [path, str(tmp_path), resume, CLIP]] for resume in (False, True)]
    ranks = run(plan, calls)
    for whole, resumed in ranks:
        assert [whole["hypers"][str(k)] for k in range(STEPS)] == hypers
        assert [whole["losses"][str(k)] for k in range(STEPS)] == pytest.approx(losses, abs=1e-5)
        assert resumed["hypers"] == {k: whole["hypers"][k] for k in resumed["hypers"]}
    end, again = final_weights(tmp_path / "end", STEPS), final_weights(tmp_path / "resumed", STEPS)
    assert max_diff(end, weights) <= 1e-5
    assert all(torch.equal(end[k], again[k]) for k in end)
