"""The user's own loss on a Hugging Face model, token-weighted, under real processes: a factory
module written here (GPT-2 with a label-smoothing loss returning (loss_sum, count), a dataset of
token sequences padded per batch with -100 labels) goes through ``hybridpipe profile``,
``partition --loss-normalization tokens`` and ``hybridpipe.launch`` on 2 stages x 2 replicas (4
rank processes; torchrun itself: test_launch.py); every step's reported loss and the merged
weights equal a plain single-process loop that takes each step's 8 samples as ONE batch (within 1e-6)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

from hybridpipe.cli import main
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import ROOT, launch, max_diff
from tests.runtime.test_hf_launch import merge_keeps_the_tie_and_refuses_differing_copies

pytest.importorskip("transformers")

FACTORY = '''
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset


def smoothed(output, labels):
    logits, shifted = output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    total = F.cross_entropy(logits, shifted, ignore_index=-100, label_smoothing=0.1, reduction="sum")
    return total, (shifted != -100).sum()


def gpt2(vocab=64):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(1, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, smoothed, ids


class Ragged(Dataset):
    def __init__(self, n=32, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, vocab, (n,), generator=g) for n in torch.randint(3, 13, (n,), generator=g)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.where(ids % 4 == 0, -100, ids)

    @staticmethod
    def collate_fn(samples):
        def pad(rows, value):
            return nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)
        return ({k: pad([s[0][k] for s in samples], 0) for k in ("input_ids", "attention_mask")},
                pad([s[1] for s in samples], -100))


def ragged():
    return Ragged()
'''
STEPS, M, B, LR, MOMENTUM = 3, 4, 2, 0.05, 0.5


def one_process(module) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: seed 0, SGD; each step one forward and backward on its M x B samples at once."""
    torch.manual_seed(0)
    model = module.gpt2()[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data, losses = module.ragged(), []
    for k in range(STEPS):
        inputs, labels = data.collate_fn([data[k * M * B + i] for i in range(M * B)])
        total, count = module.smoothed(model(**inputs), labels)
        loss = total / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_user_loss_on_hf_model_token_weighted_through_profile_partition_launch(tmp_path, monkeypatch, capsys):
    (tmp_path / "myloss.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    profile, plan, ckpt, run = (tmp_path / n for n in ("profile.json", "plan.json", "ckpt", "run"))
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"levels": [{"name": "node", "workers": 4, "bandwidth_gbps": 100}], "memory_gb": 16}))
    assert main(["profile", "myloss:gpt2", "-b", str(B), "--repeats", "1", "-q", "-o", str(profile)]) == 0
    assert main(["partition", str(profile), "--cluster", str(tmp_path / "cluster.json"), "--strategy", "uniform",
                 "--stages", "2", "--micro-batches", str(M), "--loss-normalization", "tokens", "-q",
                 "-o", str(plan)]) == 0
    written = json.loads(plan.read_text())
    assert written["loss_normalization"] == "tokens" and [s["replicas"] for s in written["stages"]] == [2, 2]

    done = launch(["--plan", str(plan), "--steps", str(STEPS), "--dataset", "myloss:ragged", "--lr", str(LR),
                   "--momentum", str(MOMENTUM), "--checkpoint-dir", str(ckpt), "--run-dir", str(run),
                   "--no-progress", "--no-trace", "--timeout", "120"], 4, timeout=300,
                  env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert all(r.returncode == 0 for r in done), done
    summary = json.loads((run / "summary.json").read_text())
    assert summary["loss_normalization"] == "tokens" and all(summary["replicas_identical"].values()), summary

    sys.modules.pop("myloss", None)
    weights, losses = one_process(importlib.import_module("myloss"))
    assert [abs(summary["loss"][str(k)] - losses[k]) <= 1e-6 for k in range(STEPS)] == [True] * STEPS, \
        (summary["loss"], losses)
    merged = tmp_path / "model.pt"
    assert main(["merge-checkpoint", str(ckpt), "-o", str(merged)]) == 0
    state = torch.load(merged, weights_only=True)
    assert max_diff(state, weights) <= 1e-6

    # the embedding tied to the head, cut apart: merged still tied; a differing copy is refused
    cut = load_plan(plan)
    assert [(t.param, t.stages) for t in cut.tied] == [("transformer.wte.weight", (0, 1))]
    merge_keeps_the_tie_and_refuses_differing_copies(tmp_path, cut, ckpt, STEPS, "transformer.wte.weight", capsys)
