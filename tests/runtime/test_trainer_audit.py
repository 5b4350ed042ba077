"""Audit: the Trainer with optimizer features of a plain PyTorch loop, on real rank processes (gloo),
against that loop written here or against itself uninterrupted.

* AdamW in two parameter groups (matrices decayed at one learning rate, vectors undecayed at another)
  under OneCycleLR, which moves Adam's beta1 along with the learning rate every step (the README's
  own example scheduler), saved after 3 of 6 steps and resumed; with clipping, against one process.
* A frozen layer (requires_grad=False) on a replicated stage built a stage at a time, with those groups.
* A checkpoint resumed under another plan (resharded): the scheduler and the fp16 loss scale continue.

All are multi-process (7-13 s): make test-slow. The resume's cause has a default unit test
(tests/runtime/test_reshard.py::test_resumed_state_brings_back_the_hyperparameters_a_scheduler_moved),
so has the resharded scheduler's
(tests/runtime/test_lr_and_batches.py::test_a_replayed_scheduler_is_where_the_uninterrupted_one_is).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

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


def reference(plan) -> tuple[dict, list[float], list[list], list[float]]:
    """The unsplit model in one process: the same groups, scheduler and clipping; weights, losses and
    each step's hyperparameters."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = grouped_adamw([p for p in model.parameters() if p.requires_grad])
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
    return model.state_dict(), losses, hypers, norms


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "gradients", "parameters"])
def test_grouped_adamw_under_one_cycle_equals_one_process_and_resumes_bitwise(tmp_path, shard):
    """Before the fix a resumed run took its first step with OneCycleLR's step-0 beta1 (0.95 instead of
    0.875: the checkpoint's hyperparameters were dropped for the new optimizer's) and ended 2.0e-2 from
    the uninterrupted run after 3 more steps (mlp, 2 stages); the same with the replicas sharded
    (the groups' state gathered into the checkpoint and cut back into pieces on resume)."""
    plan = make_plan("mlp", [3], [2, 2], schedule="1f1b", micro_batches=4, batch_size=2)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages))
    weights, losses, hypers, _ = reference(plan)
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


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "optimizer", "gradients", "parameters"])
def test_frozen_parameters_and_groups_on_replicated_stages_equal_one_process(tmp_path, shard):
    """A frozen first layer (requires_grad=False) in a replicated stage that builds only its own
    parameters, AdamW with a decayed and an undecayed group at their own OneCycleLR rates, clipping
    by the global norm: 2 x 2 ranks end where one process does (measured 1.2e-7), the frozen layer
    bitwise unchanged on every rank, the same norms; likewise with the replicas sharded (ZeRO-1, 2, 3:
    each piece of a parameter in its group, refused before this stop)."""
    plan = make_plan("tests.runtime.audit_ranks:frozen_mlp", [1], [2, 2], schedule="1f1b", micro_batches=4,
                     batch_size=2)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=shard) for s in plan.stages))
    weights, losses, _, norms = reference(plan)
    path = save_plan(plan, tmp_path / "plan.json")
    ranks = run(plan, [["train_grouped", [str(path), CLIP]]])
    for (value,) in ranks:
        assert value["losses"] == pytest.approx(losses, abs=1e-6)
        assert value["norms"] == pytest.approx(norms, rel=1e-5)
        for name, frozen in value["frozen"].items():
            assert torch.equal(torch.tensor(frozen), weights[name]), name
    assert sum(len(v[0]["frozen"]) for v in ranks) == 4            # a.weight, a.bias on stage 0's two ranks
    diff = max_diff(final_weights(tmp_path / "grouped", STEPS), weights)
    print("diff", diff)
    assert diff <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_resharded_resume_continues_the_scheduler_and_the_loss_scale(tmp_path, precision):
    """A checkpoint resumed under another plan of the same world (2 stages cut elsewhere: what an elastic
    restart's re-plan does) continues OneCycleLR where it was and fp16's loss scale as it was, as the
    same plan's resume does. Before: the schedule started over (steps 4 and 5 at lr 5e-3 and 8e-8 for
    1.04e-2 and 2e-2; weights 2.2e-2 from the uninterrupted run at step 6) and the loss scale restarted
    from its initial 2^28 instead of the saved 2^25 (3 overflowing steps had halved it)."""
    plan = make_plan("mlp", [3], [1, 1], schedule="1f1b", micro_batches=4, batch_size=4)
    other = make_plan("mlp", [1], [1, 1], schedule="gpipe", micro_batches=4, batch_size=4)
    path, other_path = save_plan(plan, tmp_path / "plan.json"), save_plan(other, tmp_path / "other.json")
    calls = [["resume_resharded", [str(path), str(other_path), str(tmp_path), resume, precision]]
             for resume in (False, True)]
    ranks = run(plan, calls)
    for whole, resumed in ranks:
        print(whole, resumed)
        assert resumed["hypers"] == {k: whole["hypers"][k] for k in resumed["hypers"]}
        assert resumed["scales"] == {k: whole["scales"][k] for k in resumed["scales"]}
    end, again = final_weights(tmp_path / "end", STEPS), final_weights(tmp_path / "resumed", STEPS)
    print("diff", max_diff(end, again))
    assert max_diff(end, again) <= 1e-6
