"""The synthetic task of an ``hf:`` model: one sample (its input dict, labels included) drawn from a
generator, shaped by the model class and its config, or a one-line refusal for a model whose input
or loss hybridpipe cannot make up.

* causal and masked LM: token ids, labels = inputs (a causal LM shifts them itself);
* seq2seq (``...ForConditionalGeneration``, ``...Seq2Seq...``): a copy of the input's first half
  (the model shifts the labels right into its decoder inputs); Whisper's encoder reads log-mel
  ``input_features`` (``num_mel_bins`` x ``2 * max_source_positions``) instead of tokens;
* sequence, image (and audio) classification: one label per sample, as the config's
  ``problem_type`` asks (the model's own inference where it is None: ``num_labels == 1`` is a
  regression): a class id, a float target per label (``regression``), or a multi-hot float
  vector (``multi_label_classification``);
* token classification: a class id per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory

Sample = Callable[[torch.Generator], dict[str, torch.Tensor]]


def task_sample(config: Any, cls: type, forward_args: set[str], seq: int, label_len: int, spec: str) -> Sample:
    """One synthetic sample for the model's task; refused in one line (what hybridpipe cannot make
    and what to do) for a model whose forward takes no ``labels`` or whose main input is neither
    tokens, images nor Whisper's features, and before anything is allocated when the sample alone
    would not fit in memory."""
    name = cls.__name__
    if "labels" not in forward_args:
        raise UserError(f"{spec}: {name}.forward takes no labels, so it computes no loss hybridpipe can train on; "
                        "name a class with a training head (e.g. ...ForSequenceClassification), or give your own "
                        "factory package.module:factory returning (model, example, loss_fn)")
    main = getattr(cls, "main_input_name", "input_ids")
    whisper = main == "input_features" and hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions")
    if main not in ("input_ids", "pixel_values") and not whisper:
        raise UserError(f"{spec}: {name} reads {main!r}, an input hybridpipe's synthetic data does not make (it makes "
                        "token ids, images and Whisper's log-mel features); give your own factory "
                        "package.module:factory returning (model, example) with a real example input")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
    seq = seq or min(128, int(positions))
    require_memory(8 * (2 * seq + label_len), f"one sample of {seq:,} tokens", "choose a smaller seq")
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    if "ConditionalGeneration" in name or "Seq2Seq" in name:
        n = label_len or max(seq // 2, 1)
        if whisper:
            shape = (int(config.num_mel_bins), 2 * int(config.max_source_positions))
            return lambda g: {"input_features": torch.randn(*shape, generator=g),
                              "labels": torch.randint(0, vocab, (n,), generator=g)}
        return lambda g: _copy_task(torch.randint(0, vocab, (seq,), generator=g), n)
    if "TokenClassification" in name:
        classes = int(getattr(config, "num_labels", 2))
        return lambda g: {"input_ids": torch.randint(0, vocab, (seq,), generator=g),
                          "labels": torch.randint(0, classes, (seq,), generator=g)}
    if "Classification" in name:
        label = _label(config)
        if main == "pixel_values":
            size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
            return lambda g: {"pixel_values": torch.randn(channels, size, size, generator=g), "labels": label(g)}
        return lambda g: {"input_ids": torch.randint(0, vocab, (seq,), generator=g), "labels": label(g)}
    return lambda g: _same(torch.randint(0, vocab, (seq,), generator=g))


def _label(config: Any) -> Callable[[torch.Generator], torch.Tensor]:
    """One sample's label as the config's ``problem_type`` (or, where None, the model's inference
    from ``num_labels``) reads it: a class id, floats of N(0, 1) (regression: a scalar for one
    label, one per label otherwise), or a multi-hot float vector."""
    n = int(getattr(config, "num_labels", 2))
    kind = getattr(config, "problem_type", None) or ("regression" if n == 1 else "single_label_classification")
    if kind == "regression":
        shape: tuple[int, ...] = () if n == 1 else (n,)
        return lambda g: torch.randn(shape, generator=g)
    if kind == "multi_label_classification":
        return lambda g: torch.randint(0, 2, (n,), generator=g).float()
    return lambda g: torch.randint(0, n, (), generator=g)


def _same(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids.clone()}


def _copy_task(ids: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids[:n].clone()}
