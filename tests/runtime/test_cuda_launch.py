"""launch.py on GPUs with NCCL (skipped without CUDA): the same weights as single-process training."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.partitioner.plan import save_plan
from tests.pipeline.harness import make_plan
from tests.runtime.jobs import final_weights, launch, max_diff, train_reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nccl_pipeline_matches_single_process(tmp_path):
    gpus = torch.cuda.device_count()
    plan = (make_plan("mlp", [3, 6], [1, 1, 1], micro_batches=4, batch_size=8) if gpus >= 3 else
            make_plan("mlp", [3], [1, 1], micro_batches=4, batch_size=8) if gpus == 2 else
            make_plan("mlp", [], [1], micro_batches=4, batch_size=8))
    save_plan(plan, tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", "5", "--lr", "0.05", "--momentum", "0.5",
                   "--backend", "nccl", "--checkpoint-dir", str(ckpt), "--run-dir", str(tmp_path / "run"),
                   "--no-progress", "--timeout", "120"], plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    reference = train_reference(plan, 5, lr=0.05, momentum=0.5, seed=0)
    assert max_diff(final_weights(ckpt, 5), reference) <= 1e-4      # GPU kernels round differently
