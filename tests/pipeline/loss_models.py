"""Tiny Hugging Face models with the user's own losses, and token datasets with varying padding and
-100 labels, for the loss tests (``tests.pipeline.loss_models:FACTORY``; not a test file).

Every model has no dropout, so a pipeline can be compared with one process to rounding.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

IGNORE = -100


def _gpt2(layers: int, width: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=vocab, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _distilbert(cls_name: str, layers: int, width: int, vocab: int, **extra):
    import transformers

    config = transformers.DistilBertConfig(vocab_size=vocab, dim=width, n_layers=layers, n_heads=2,
                                           hidden_dim=2 * width, max_position_embeddings=128, dropout=0.0,
                                           attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0, **extra)
    return getattr(transformers, cls_name)(config)


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


# ---- the user's own losses ------------------------------------------------------------------
def smoothed_lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy with label smoothing on GPT-2's logits (mean over labels != -100)."""
    logits = output.logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=IGNORE, label_smoothing=0.1)


def smoothed_lm_pair(output, labels: torch.Tensor):
    """The same loss as (sum, count): what ``--loss-normalization tokens`` asks for."""
    logits = output.logits[:, :-1].flatten(0, 1)
    shifted = labels[:, 1:].flatten()
    total = F.cross_entropy(logits, shifted, ignore_index=IGNORE, label_smoothing=0.1, reduction="sum")
    return total, (shifted != IGNORE).sum()


def masked_tag_loss(output, target: dict) -> torch.Tensor:
    """Per-token tagging loss weighted by a mask given with the target (a dict): mean over the mask."""
    per_token = F.cross_entropy(output.logits.transpose(1, 2), target["tags"], reduction="none")
    return (per_token * target["mask"]).sum() / target["mask"].sum()


def masked_tag_pair(output, target: dict):
    per_token = F.cross_entropy(output.logits.transpose(1, 2), target["tags"], reduction="none")
    return (per_token * target["mask"]).sum(), target["mask"].sum()


# ---- factories ----------------------------------------------------------------------------------
def gpt2_smoothed(layers: int = 2, width: int = 32, vocab: int = 96, seq: int = 12, batch: int = 2,
                  pair: bool = False):
    """GPT-2 with a label-smoothing loss on its logits: input {input_ids, attention_mask}, target
    the token labels (-100: padding and ignored tokens)."""
    ids = _ids(batch, seq, vocab)
    loss = smoothed_lm_pair if pair else smoothed_lm_loss
    return _gpt2(layers, width, vocab), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, loss, ids.clone()


def distilbert_tagger(layers: int = 2, width: int = 32, vocab: int = 96, tags: int = 5, seq: int = 12,
                      batch: int = 2, pair: bool = False):
    """An encoder classifier (DistilBERT token classification) with a masked loss: the target is
    a dict {tags, mask}."""
    ids = _ids(batch, seq, vocab)
    model = _distilbert("DistilBertForTokenClassification", layers, width, vocab, num_labels=tags)
    target = {"tags": ids % tags, "mask": (ids % 3 != 0).float()}
    loss = masked_tag_pair if pair else masked_tag_loss
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, loss, target


def gpt2_own(layers: int = 2, width: int = 32, vocab: int = 96, seq: int = 12, batch: int = 2):
    """GPT-2 computing its own loss from ``labels`` (-100: ignored)."""
    ids = _ids(batch, seq, vocab)
    return _gpt2(layers, width, vocab), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "labels": ids.clone()}


def distilbert_mlm(layers: int = 2, width: int = 32, vocab: int = 96, seq: int = 12, batch: int = 2):
    """DistilBERT masked LM computing its own loss from ``labels`` (-100 everywhere but masked tokens)."""
    ids = _ids(batch, seq, vocab)
    return (_distilbert("DistilBertForMaskedLM", layers, width, vocab),
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})


# ---- data ---------------------------------------------------------------------------------------
class Ragged(Dataset):
    """Token sequences of ``low``..``high`` tokens with some labels -100; ``collate_fn`` pads a batch
    to its longest sequence (ids 0, mask 0, labels -100). ``kind``: "lm" (labels = the ids, ~1 in 4
    ignored), "mlm" (~1 in 3 tokens masked to id 1 and labelled, the rest -100), "lm-pairs" /
    "tags-pairs" ((input, target) pairs for a loss function: the labels, or {tags, mask})."""

    def __init__(self, kind: str = "lm", n: int = 64, vocab: int = 96, low: int = 3, high: int = 14,
                 seed: int = 0, tags: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.tags, self.items = kind, tags, []
        for length in torch.randint(low, high + 1, (n,), generator=g).tolist():
            ids = torch.randint(2, vocab, (length,), generator=g)
            drop = torch.rand(length, generator=g)
            self.items.append((ids, drop))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        ids, drop = self.items[i]
        if self.kind == "mlm":
            masked = drop < 0.33
            return {"input_ids": torch.where(masked, torch.ones_like(ids), ids),
                    "attention_mask": torch.ones_like(ids), "labels": torch.where(masked, ids, IGNORE)}
        labels = torch.where(drop < 0.25, IGNORE, ids)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.kind == "lm":
            return {**inputs, "labels": labels}
        if self.kind == "lm-pairs":
            return inputs, labels
        return inputs, {"tags": ids % self.tags, "mask": (drop >= 0.25).float()}

    @staticmethod
    def collate_fn(samples: list):
        def pad(rows: list[torch.Tensor], value: float) -> torch.Tensor:
            return nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)

        def batch(dicts: list[dict], fills: dict[str, float]) -> dict[str, torch.Tensor]:
            return {k: pad([d[k] for d in dicts], fills.get(k, 0)) for k in dicts[0]}

        fills = {"labels": IGNORE}
        if isinstance(samples[0], dict):
            return batch(samples, fills)
        inputs = batch([s[0] for s in samples], fills)
        targets = [s[1] for s in samples]
        target = batch(targets, {}) if isinstance(targets[0], dict) else pad(targets, IGNORE)
        return inputs, target


def ragged(kind: str = "lm", n: int = 64, vocab: int = 96, low: int = 3, high: int = 14, seed: int = 0) -> Ragged:
    return Ragged(kind, n, vocab, low, high, seed)


class TinyTagger(nn.Module):
    """Token ids -> per-token scores over ``tags`` classes (tensor in, tensor out)."""

    def __init__(self, vocab: int = 32, width: int = 16, tags: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def token_pair_loss(scores: torch.Tensor, tags: torch.Tensor):
    """Per-token cross-entropy as (sum, count) over the tags that are not -100."""
    total = F.cross_entropy(scores.flatten(0, 1).float(), tags.flatten(), ignore_index=IGNORE, reduction="sum")
    return total, (tags != IGNORE).sum()


def tiny_tagger(seq: int = 6, batch: int = 4):
    """A small non-Hugging Face model with a (loss_sum, count) loss (fp16 runs on the CPU too)."""
    ids = torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(0))
    return TinyTagger(), ids, token_pair_loss
