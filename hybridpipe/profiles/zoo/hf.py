"""Hugging Face ``transformers`` models by name: ``hf:MODEL[key=value,...]`` (an optional dependency).

* ``hf:gpt2[n_layer=4,n_embd=64,vocab_size=512]``: the model type's config class with those
  fields, random weights (nothing is downloaded), and the model type's default training head:
  causal LM, else seq2seq LM, else masked LM, else image classification.
* ``hf:BertForSequenceClassification[num_hidden_layers=2,num_labels=3]``: a model class by name.
* ``hf:/path/to/checkpoint``: a model saved with ``save_pretrained`` (its config and weights).

Reserved arguments (not passed to the config): ``seq`` (tokens per synthetic sample, default
``min(128, max positions)``), ``dropout`` (set every dropout probability of the config, e.g.
``dropout=0`` for exact comparisons), ``labels`` (target length of a seq2seq task), ``leaf``
(module classes never split into several nodes, ``leaf=A+B``).

Synthetic data is the task's own: next-token prediction over the vocabulary for a causal LM
(``{"input_ids", "labels"}``: labels = inputs, the model shifts them), masked-LM reconstruction,
a seq2seq copy of half the input, one class per sequence or image. The model computes its own
loss from ``labels`` (``ModelSpec.loss = None``). ``use_cache`` is switched off by the capture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo.spec import ModelSpec, parse_args

HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModelForImageClassification",
         "AutoModelForSequenceClassification")
RESERVED = ("seq", "dropout", "labels", "leaf")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError("hf: models need the transformers package: pip install 'hybridpipe[hf]' "
                        "(or pip install transformers)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def hf_spec(spec: str) -> ModelSpec:
    """The ModelSpec of ``hf:NAME[k=v,...]`` or ``hf:/path`` (see the module docstring)."""
    body = spec[len("hf:"):].strip()
    name, _, rest = body.partition("[")
    kwargs = parse_args(f"[{rest}" if rest else "", spec)
    reserved = {k: kwargs.pop(k) for k in RESERVED if k in kwargs}
    tf = _transformers()
    if os.path.sep in name or os.path.isdir(name):
        cls, build, config = _from_directory(tf, name, kwargs)
    else:
        cls, build, config = _from_name(tf, name, kwargs)
    if "dropout" in reserved:
        _set_dropout(config, float(reserved["dropout"]))
    sample = _task_sample(config, cls.__name__, int(reserved.get("seq", 0)), int(reserved.get("labels", 0)))
    leaves = tuple(x for x in str(reserved.get("leaf", "")).split("+") if x)
    return ModelSpec(name=spec, build=lambda: build(config), loss=None, sample=sample, leaf_modules=leaves)


Built = tuple[type, Callable[[Any], nn.Module], Any]


def _from_name(tf: Any, name: str, kwargs: dict) -> Built:
    cls: Any = getattr(tf, name, None)
    if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel):
        try:
            config_class: Any = cls.config_class  # type: ignore[attr-defined]  # a PreTrainedModel subclass
            return cls, cls, config_class(**kwargs)
        except (TypeError, ValueError) as e:
            raise UserError(f"bad arguments for hf:{name}: {e}") from None
    try:
        config = tf.AutoConfig.for_model(name, **kwargs)
    except ValueError:
        raise UserError(f"hf:{name} is neither a transformers model class (like GPT2LMHeadModel) nor a model type "
                        "(like gpt2, llama, bert, t5, vit)") from None
    except TypeError as e:
        raise UserError(f"bad arguments for hf:{name}: {e}") from None
    for head in HEADS:
        mapping = getattr(tf, head)._model_mapping
        if type(config) in mapping:
            cls = mapping[type(config)]
            return cls, cls, config
    raise UserError(f"hf:{name} has no training head hybridpipe knows ({', '.join(HEADS)}); name the model class, "
                    f"e.g. hf:{type(config).__name__.removesuffix('Config')}For...")


def _from_directory(tf: Any, path: str, kwargs: dict) -> Built:
    if not os.path.isdir(path):
        raise UserError(f"hf:{path} is not a directory saved with save_pretrained")
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config in {path}: {e}") from None
    arch = (config.architectures or [None])[0]
    cls = getattr(tf, arch, None) if arch else None
    if cls is None:
        raise UserError(f"{path}/config.json names no model class (\"architectures\"); save it with save_pretrained")

    def build(cfg: Any) -> nn.Module:
        return cls.from_pretrained(path, config=cfg, local_files_only=True)

    return cls, build, config


def _set_dropout(config: Any, p: float) -> None:
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            setattr(config, key, p)


def _task_sample(config: Any, model_cls: str, seq: int,
                 label_len: int) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    """One synthetic sample for the model's task (its input dict, labels included)."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
    seq = seq or min(128, int(positions))
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    num_labels = int(getattr(config, "num_labels", 2))
    if "ImageClassification" in model_cls:
        size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
        return lambda g: {"pixel_values": torch.randn(channels, size, size, generator=g),
                          "labels": torch.randint(0, num_labels, (), generator=g)}
    if "SequenceClassification" in model_cls:
        return lambda g: {"input_ids": torch.randint(0, vocab, (seq,), generator=g),
                          "labels": torch.randint(0, num_labels, (), generator=g)}
    if "ConditionalGeneration" in model_cls or "Seq2Seq" in model_cls:
        n = label_len or max(seq // 2, 1)
        return lambda g: _copy_task(torch.randint(0, vocab, (seq,), generator=g), n)
    return lambda g: _same(torch.randint(0, vocab, (seq,), generator=g))


def _same(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids.clone()}


def _copy_task(ids: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids[:n].clone()}
