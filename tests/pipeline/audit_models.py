"""Tiny Hugging Face models and datasets of the correctness audit (tests/pipeline/test_hf_audit.py),
named ``tests.pipeline.audit_models:FACTORY`` (not a test file). Random weights, nothing downloaded
(tests/conftest.py sets HF_HUB_OFFLINE), no dropout unless asked.

* Padded batches whose padding the model must not see: an encoder (DistilBERT, bidirectional: every
  token attends to every other one unless the mask says otherwise) and a decoder padded on the LEFT
  (Llama: a real token after the padding would attend to it without the mask). Right padding of a
  causal model (tests/profiles/user_models.py:gpt2_padded) cannot tell a dropped mask from a kept
  one: no real token attends to a later position. Each model is captured on an example whose
  attention mask is all ones, as a user's first batch often is.
* Mistral with a sliding window shorter than the sequences, on batches padded to lengths on both
  sides of the window.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 128


class PaddedTokens(Dataset):
    """Token sequences of ``low``..``high`` tokens (ids 2..VOCAB-1); ``collate_fn`` pads a batch to its
    longest one on the ``side`` given (input id 0, attention mask 0, label -100)."""

    def __init__(self, n: int, low: int, high: int, side: str = "right", seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (n,), generator=g)
        self.items = [torch.randint(2, VOCAB, (int(length),), generator=g) for length in lengths]
        self.side = side

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)

        def pad(key: str, value: int) -> torch.Tensor:
            rows = []
            for s in samples:
                fill = torch.full((longest - len(s[key]),), value, dtype=s[key].dtype)
                rows.append(torch.cat([fill, s[key]] if self.side == "left" else [s[key], fill]))
            return torch.stack(rows)

        return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", -100)}


def padded_tokens(n: int = 24, low: int = 3, high: int = 12, side: str = "right", seed: int = 0) -> PaddedTokens:
    return PaddedTokens(n, low, high, side, seed)


def _example(seq: int = 8, batch: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def distilbert_padded() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A DistilBERT masked LM (bidirectional; its head tied to the word embedding)."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(n_layers=2, dim=32, hidden_dim=64, n_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, qa_dropout=0.0,
                              seq_classif_dropout=0.0)
    return DistilBertForMaskedLM(config), _example()


def llama_left_padded() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Llama causal LM (grouped key/value heads) for batches padded on the left."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(config), _example()


def mistral_window(window: int = 4) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Mistral causal LM whose sliding window (``window`` tokens) is shorter than its sequences."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=window,
                           pad_token_id=0)
    return MistralForCausalLM(config), _example()


class Images(Dataset):
    """``n`` random ``size`` x ``size`` RGB images with one of 5 labels each (an image classifier's samples)."""

    def __init__(self, n: int = 16, size: int = 33, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [{"pixel_values": torch.randn(3, size, size, generator=g),
                       "labels": torch.randint(0, 5, (), generator=g)} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def images33(n: int = 16) -> Images:
    """33 x 33 images: not what a MobileNetV2 captured on 32 x 32 computes on (its padding is fixed)."""
    return Images(n, 33)
