"""The engine on a GPU: stages on CUDA, threads + in-process transport (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline.harness import make_plan, max_diff, train_pipeline, train_reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("model,cuts,granularity", [
    ("mlp", [2, 5], "blocks"),
    ("gpt[layers=2,width=32,heads=2,seq=8,vocab=64]", [4, 12], "modules"),    # cuts inside the blocks
    ("tests.profiles.moe_models:moe[leaf=Experts]", [0, 1], "blocks"),        # leaf experts run as written
])
def test_cuda_pipeline_equals_single_process(model, cuts, granularity, schedule):
    torch.backends.cuda.matmul.allow_tf32 = False
    plan = make_plan(model, cuts, [1, 2, 1], schedule=schedule, micro_batches=4, batch_size=4,
                     granularity=granularity)
    ours, _ = train_pipeline(plan, 5, device="cuda")
    assert max_diff(ours, train_reference(plan, 5, device="cuda")) <= 1e-5
