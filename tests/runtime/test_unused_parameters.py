"""Parameters and saved buffers the forward never uses (BartForCausalLM's cross-attention, a spare
layer): the stage of their nearest module holds them, so a checkpoint has every tensor of the model,
unchanged by training as in one process (the optimizer skips a parameter without a gradient), and
merge-checkpoint's check and the Hugging Face export pass (before: no stage held them;
merge-checkpoint refused the run's checkpoint, "missing 20 key(s)")."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import capture, make_plan
from tests.runtime.jobs import final_weights, launch, max_diff
from tests.runtime.test_adamw import LR, SEED, STEPS, WD, plain_loop

SPARE = "tests.profiles.user_models:with_spare"


def test_the_nearest_blocks_stage_holds_an_unused_parameter():
    plan = make_plan(SPARE, [1], [1, 1], batch_size=4)
    captured = capture(resolve_model(plan.model), plan.batch_size)
    assert "spare.weight" not in {n for names in captured.read_params() for n in names}
    held = captured.block_params()
    owners = [captured.blocks[i].name for i, names in enumerate(held) if "spare.weight" in names]
    assert owners == ["inp"]                                          # no common path: the first block
    ranges = [(s.first_node, s.last_node) for s in plan.stages]
    keys = [k for i in range(2) for k in build_stage_index(captured, ranges, i).module.state_dict()]
    assert sorted(keys) == sorted(captured.module.state_dict())      # every tensor, once


@pytest.mark.parametrize("spec,cut", [
    (SPARE, [1]),
    pytest.param("hf:BartForCausalLM[encoder_layers=2,decoder_layers=2,d_model=32,encoder_ffn_dim=64,"
                 "decoder_ffn_dim=64,"
                 "encoder_attention_heads=2,decoder_attention_heads=2,vocab_size=128,max_position_embeddings=64,"
                 "seq=8,dropout=0]", [2], marks=pytest.mark.slow, id="bart-causal")])
def test_an_unused_parameter_is_saved_unchanged_and_merges(tmp_path, spec, cut):
    plan = make_plan(spec, cut, [1, 1], micro_batches=2, batch_size=2)
    save_plan(plan, tmp_path / "plan.json")
    done = launch(["--plan", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--lr", str(LR), "--optimizer",
                   "adamw", "--weight-decay", str(WD), "--seed", str(SEED), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--run-dir", str(tmp_path / "run"), "--timeout", "120", "--no-progress", "--no-trace"],
                  plan.world_size, timeout=300)
    assert all(d.returncode == 0 for d in done), done
    merged, reference = final_weights(tmp_path / "ck", STEPS), plain_loop(plan, torch.optim.AdamW)
    assert max_diff(merged, reference) <= 1e-5            # AdamW on tiny gradients: float rounding
    built = resolve_model(spec)
    torch.manual_seed(SEED)
    initial = built.build().state_dict()
    unused = [k for k in initial if "spare" in k or "encoder_attn" in k or k == "calls"]
    assert unused and all(torch.equal(merged[k], initial[k]) for k in unused)   # AdamW's decay skipped them too
    assert main(["merge-checkpoint", str(tmp_path / "ck"), "-o", str(tmp_path / "m.pt")]) == 0
