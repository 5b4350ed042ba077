"""Virtual stages through launch.py and torchrun (real processes, gloo): a rank holding several model
chunks trains to single-process training's weights; its checkpoint (each chunk's stage file) merges
and resumes."""

from __future__ import annotations

import json
import shutil

import pytest

from hybridpipe.partitioner.plan import save_plan
from hybridpipe.runtime.checkpoint_files import step_dir
from tests.pipeline.harness import make_plan
from tests.pipeline.hf_models import GPT2
from tests.runtime.jobs import final_weights, launch, max_diff, torchrun, train_reference

STEPS, LR, MOMENTUM, SEED = 5, 0.05, 0.5, 3


def gpt2_zbv(tmp_path):
    """zbv on 2 rank groups (group 0 replicated): GPT-2's tied embedding and head both on group 0."""
    pytest.importorskip("transformers")
    plan = make_plan(GPT2, [0, 3, 4], [2, 1], schedule="zbv", micro_batches=4, batch_size=2, virtual_stages=2)
    assert [t.stages for t in plan.tied] == [(0, 3)]
    save_plan(plan, tmp_path / "plan.json")
    return plan


@pytest.mark.slow
def test_zbv_tied_gpt2_through_torchrun_matches_single_process(tmp_path):
    plan = gpt2_zbv(tmp_path)
    ckpt = tmp_path / "ckpt"
    done = torchrun(["--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--lr", str(LR), "--momentum",
                     str(MOMENTUM), "--seed", str(SEED), "--checkpoint-dir", str(ckpt), "--run-dir",
                     str(tmp_path / "run"), "--timeout", "60", "--no-progress"], plan.world_size, timeout=240)
    assert done.returncode == 0, done
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["replicas_identical"] == {"0": True, "3": True}, summary["replicas_identical"]
    reference = train_reference(plan, STEPS, lr=LR, momentum=MOMENTUM, seed=SEED)
    assert max_diff(final_weights(ckpt, STEPS), reference) <= 1e-5


@pytest.mark.slow
def test_interleaved_resume_from_mid_run_checkpoint(tmp_path):
    plan = make_plan("mlp", [1, 3, 5], [1, 2], schedule="interleaved-1f1b", micro_batches=4, batch_size=4,
                     virtual_stages=2)
    save_plan(plan, tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    args = ["--plan", str(tmp_path / "plan.json"), "--steps", "6", "--checkpoint-dir", str(ckpt), "--lr", "0.05",
            "--momentum", "0.5", "--timeout", "60", "--no-progress", "--no-trace"]
    done = launch([*args, "--checkpoint-every", "3", "--run-dir", str(tmp_path / "a")], 3, timeout=180)
    assert all(d.returncode == 0 for d in done), done
    straight = final_weights(ckpt, 6)
    assert max_diff(straight, train_reference(plan, 6, lr=0.05, momentum=0.5, seed=0)) <= 1e-5
    shutil.rmtree(step_dir(ckpt, 6))           # as if the job had died after step 5
    done = launch([*args, "--resume", "--run-dir", str(tmp_path / "b")], 3, timeout=180)
    assert all(d.returncode == 0 for d in done), done
    assert max_diff(final_weights(ckpt, 6), straight) <= 1e-6
    # the chunks' stage files reshard into a plan without virtual stages: one more step of 1f1b
    other = make_plan("mlp", [3], [1, 1], schedule="1f1b", micro_batches=4, batch_size=4)
    save_plan(other, tmp_path / "other.json")
    args[1] = str(tmp_path / "other.json")
    args[3] = "7"
    done = launch([*args, "--resume", "--run-dir", str(tmp_path / "c")], 2, timeout=180)
    assert all(d.returncode == 0 for d in done), done
    assert max_diff(final_weights(ckpt, 7), train_reference(plan, 7, lr=0.05, momentum=0.5, seed=0)) <= 1e-5
