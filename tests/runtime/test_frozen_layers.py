"""A frozen parameter (``requires_grad`` False) on a replicated stage of a plan ``partition`` wrote:
the profile lists every parameter its nodes own, so the plan's sync layers name the frozen one too
(Whisper's sinusoidal position table; a fine-tuning's frozen embedding). Launch refused such a plan
("the plan syncs parameter ..., which the stage does not have ... re-partition", and re-partitioning
wrote the same plan); it now leaves the frozen parameters out of the sync."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from hybridpipe.cli import main
from hybridpipe.partitioner.cost.syncunits import LayerSync
from hybridpipe.partitioner.plan import Stage, load_plan
from hybridpipe.pipeline.plancheck import check_sync_layers
from hybridpipe.runtime.sync import trainable_layers
from tests.runtime.jobs import ROOT, final_weights, launch, max_diff, train_reference

LAYERS = (LayerSync("0", ("0.weight", "0.bias"), 24 + 12, "ring", unit=0),
          LayerSync("1", ("1.weight", "1.bias"), 24 + 8, "ring", unit=0))


def net(*frozen: str) -> nn.Module:
    module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    for name in frozen:
        module.get_parameter(name).requires_grad_(False)
    return module


def test_a_planned_frozen_parameter_is_accepted_and_left_out_of_the_sync():
    stage = Stage(index=0, first_node=0, last_node=1, replicas=2, ranks=(0, 1), layers=LAYERS)
    check_sync_layers(stage, net("0.weight"))                  # UserError before
    assert trainable_layers(LAYERS, net("0.weight")) == (replace(LAYERS[0], params=("0.bias",), bytes=12), LAYERS[1])
    assert trainable_layers(LAYERS, net("0.weight", "0.bias")) == (LAYERS[1],)     # a layer left empty: dropped
    assert trainable_layers(LAYERS, net()) == LAYERS
    with pytest.raises(Exception, match="do not sync parameter '1.bias'"):       # a trainable one still checked
        check_sync_layers(replace(stage, layers=(LAYERS[0], replace(LAYERS[1], params=("1.weight",)))), net())


@pytest.mark.slow
def test_partitions_plan_with_a_frozen_layer_trains_on_replicas_as_one_process(tmp_path):
    """profile -> partition (2 x 2; the frozen layer ``a`` has no trainable bytes, so its layers leave it out:
    nothing to sync) -> launch (4 ranks) -> the merged checkpoint equals one process's SGD (the frozen layer
    unchanged). A plan that does list a frozen parameter (a layer partly frozen) is accepted: the test above."""
    model = "tests.runtime.audit_ranks:frozen_mlp"
    profile, plan_path = tmp_path / "p.json", tmp_path / "plan.json"
    assert main(["profile", model, "-b", "2", "--repeats", "1", "--warmup", "0", "-q", "-o", str(profile)]) in (0, None)
    assert main(["partition", str(profile), "--cluster", str(ROOT / "examples/clusters/local4.json"), "--strategy",
                 "uniform", "--stages", "2", "--micro-batches", "4", "-q", "-o", str(plan_path)]) in (0, None)
    plan = load_plan(plan_path)
    planned = {p for s in plan.stages for lv in s.layers for p in lv.params}
    assert "a.weight" not in planned and "b.weight" in planned
    done = launch(["--plan", str(plan_path), "--steps", "3", "--lr", "0.05", "--momentum", "0.5", "--seed", "3",
                   "--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run"), "--timeout", "60",
                   "--no-progress", "--no-trace"], 4, timeout=240)
    assert all(f.returncode == 0 for f in done), done
    ours = final_weights(tmp_path / "ck", 3)
    reference = train_reference(plan, 3, lr=0.05, momentum=0.5, seed=3, accumulate=True)
    assert torch.equal(ours["a.weight"], reference["a.weight"])
    assert max_diff(ours, reference) <= 1e-6
