"""The user's whole path on BART (encoder-decoder, one embedding under four names, the
``final_logits_bias`` buffer): ``hybridpipe profile`` -> ``partition`` (2 uniform stages on 4
workers, zb-h1) -> the real ``torchrun`` running launch with checkpoints -> ``merge-checkpoint
--format hf`` -> ``BartForConditionalGeneration.from_pretrained``, strict (no missing or unexpected
key). The loaded weights and buffers are the merged checkpoint's exactly, and within 1e-6 of a plain
single-process loop (tests/pipeline/test_hf_audit.py's; replicas sum their gradients in another order
than one process accumulates them: rounding). Measured 5.6e-9."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpipe.cli import main
from tests.pipeline.test_hf_audit import BART, STEPS, distance, plain_loop
from tests.runtime.jobs import ROOT, torchrun

pytest.importorskip("transformers")
SEED = 4


@pytest.mark.slow
def test_bart_profile_partition_torchrun_merge_hf_from_pretrained_equals_one_process(tmp_path):
    from transformers import BartForConditionalGeneration

    profile, plan, ckpt, out = tmp_path / "bart.json", tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "hf"
    assert main(["profile", BART, "-b", "2", "--repeats", "1", "-q", "-o", str(profile)]) in (0, None)
    assert main(["partition", str(profile), "--cluster", str(ROOT / "examples/clusters/local4.json"),
                 "--strategy", "uniform", "--stages", "2", "--schedule", "zb-h1", "--micro-batches", "4", "-q",
                 "-o", str(plan)]) in (0, None)
    done = torchrun(["--plan", str(plan), "--steps", str(STEPS), "--lr", "0.05", "--momentum", "0.5", "--seed",
                     str(SEED), "--checkpoint-dir", str(ckpt), "--timeout", "60", "--no-progress",
                     "--run-dir", str(tmp_path / "run")], 4, timeout=400)
    assert done.returncode == 0, done
    stages = json.loads(plan.read_text())["stages"]
    assert main(["merge-checkpoint", str(ckpt), "-o", str(tmp_path / "merged.pt")]) in (0, None)
    assert main(["merge-checkpoint", str(ckpt), "--format", "hf", "-o", str(out)]) in (0, None)
    model, info = BartForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    loaded = model.state_dict()
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    assert set(merged) <= set(loaded) and all(torch.equal(loaded[k], merged[k]) for k in merged)
    diff, where = distance(loaded, plain_loop(BART, seed=SEED, data_seed=SEED))
    print([(s["first_node"], s["last_node"], s["replicas"]) for s in stages], diff, where)
    assert diff <= 1e-6, (diff, where)
