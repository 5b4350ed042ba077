"""Hugging Face ``transformers`` models by name: ``hf:MODEL[key=value,...]`` (an optional dependency).

* ``hf:gpt2[n_layer=4,n_embd=64,vocab_size=512]``: the model type's config class with those
  fields, random weights (nothing is downloaded), and the model type's default training head:
  causal LM, else seq2seq LM (speech seq2seq: Whisper), else masked LM, else image classification,
  else sequence classification; an encoder-decoder type (BART, Whisper) its seq2seq head first
  (its causal LM is the decoder alone: name ``BartForCausalLM`` for that). ``attn_implementation``
  and ``experts_implementation`` (``eager``: a mixture of experts' Python loop over the experts)
  are passed to the config too.
* ``hf:BertForSequenceClassification[num_hidden_layers=2,num_labels=3]``: a model class by name.
* ``hf:/path/to/checkpoint``: a model saved with ``save_pretrained`` (its config and weights). Its
  ModelSpec names the directory as its ``weights``: the runtime builds the model with its
  parameters on the meta device and each rank reads only its own stages' tensors from the
  safetensors files (runtime/lazy.py); ``build`` is ``from_pretrained`` (the whole model).

Reserved arguments (not passed to the config): ``seq`` (tokens per synthetic sample, default
``min(128, max positions)``), ``dropout`` (set every dropout probability of the config, e.g.
``dropout=0`` for exact comparisons), ``labels`` (target length of a seq2seq task), ``leaf``
(module classes kept whole and run as written, ``leaf=A+B``: profiles/leaves.py).

Synthetic data is the task's own: next-token prediction over the vocabulary for a causal LM
(``{"input_ids", "labels"}``: labels = inputs, the model shifts them), masked-LM reconstruction,
a seq2seq copy of half the input, one class per sequence or image. The model computes its own
loss from ``labels`` (``ModelSpec.loss = None``). ``use_cache`` is switched off by the capture.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.limits import require_memory
from hybridpipe.profiles.zoo.hf_tasks import task_sample
from hybridpipe.profiles.zoo.spec import ModelSpec, call_user, check_options, parse_args

HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModelForMaskedLM",
         "AutoModelForImageClassification", "AutoModelForSequenceClassification")
SEQ2SEQ = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq")     # an encoder-decoder type's heads, tried first
RESERVED = {"seq": 128, "dropout": 0.0, "labels": 64, "leaf": ""}     # taken by hybridpipe (with examples)
IMPLEMENTATIONS = ("attn_implementation", "experts_implementation")    # config arguments kept in private fields


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
    check_options("hf model", spec.split("[")[0], RESERVED, reserved)
    if not 0 <= float(reserved.get("dropout", 0.0)) <= 1:
        raise UserError(f"hf model option dropout={reserved['dropout']} of {spec!r} must be between 0 and 1")
    if kwargs.get("gradient_checkpointing"):
        raise UserError(f"{spec.split('[')[0]}[gradient_checkpointing=true]: the captured graph cannot keep "
                        "transformers' checkpointing (each layer would run once and keep its activations); leave it "
                        "out and use hybridpipe's recomputation: partition --recompute all (or auto: only the "
                        "stages that need it)")
    tf = _transformers()
    directory = os.path.sep in name or os.path.isdir(name)
    if directory:
        cls, build, config = _from_directory(tf, name, kwargs)
    else:
        cls, build, config = _from_name(tf, name, kwargs)
    if "dropout" in reserved:
        _set_dropout(config, float(reserved["dropout"]))
    _problem_type(config, cls)
    _check_depth(spec, cls, config)
    sample = task_sample(config, cls, _forward_args(cls), int(reserved.get("seq", 0)), int(reserved.get("labels", 0)),
                         spec.split("[")[0])
    leaves = tuple(x for x in str(reserved.get("leaf", "")).split("+") if x)
    return ModelSpec(name=spec, build=lambda: build(config), loss=None, sample=sample, leaf_modules=leaves,
                     skeleton=lambda: _skeleton(tf, cls, config, name if directory else None),
                     weights=name if directory else None)


Built = tuple[type, Callable[[Any], nn.Module], Any]


def _from_name(tf: Any, name: str, kwargs: dict) -> Built:
    cls: Any = getattr(tf, name, None)
    if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel):
        make: Any = cls.config_class  # type: ignore[attr-defined]  # a PreTrainedModel subclass
    else:
        try:
            default = tf.AutoConfig.for_model(name)
        except ValueError:
            raise UserError(f"hf:{name} is neither a transformers model class (like GPT2LMHeadModel) nor a model "
                            "type (like gpt2, llama, bert, t5, vit)") from None
        heads = [*SEQ2SEQ, *HEADS] if getattr(default, "is_encoder_decoder", False) else HEADS
        cls = next((getattr(tf, head)._model_mapping[type(default)] for head in heads
                    if type(default) in getattr(tf, head)._model_mapping), None)
        if cls is None:
            raise UserError(f"hf:{name} has no training head hybridpipe knows ({', '.join(HEADS)}); name the model "
                            f"class, e.g. hf:{type(default).__name__.removesuffix('Config')}For...")

        def make(**kw: Any) -> Any:
            return tf.AutoConfig.for_model(name, **kw)
    config = _config(f"hf:{name}", make, kwargs, cls)
    _start_token(config, cls)
    return cls, cls, config


def _start_token(config: Any, cls: type) -> None:
    """T5's configs (T5, LongT5, Switch) in transformers 5 have no ``decoder_start_token_id``, which
    their models read to shift the labels right into the decoder's inputs: the pad token, as MT5's
    and UMT5's configs (and T5's own released checkpoints) say."""
    if not hasattr(config, "decoder_start_token_id") and "decoder_start_token_id" in _names_read_by(cls):
        config.decoder_start_token_id = config.pad_token_id


def _config(name: str, make: Callable[..., Any], kwargs: dict, cls: type) -> Any:
    """The config ``make(**kwargs)`` builds, each key checked first against the default config's
    fields and the names the model's code reads (a key neither has is refused, not stored unused; a
    value of another type than the field's default, or a negative whole number, is refused), and
    any error building it one line."""
    default = call_user(f"{name}'s config", make)
    fields = {k: v for k, v in vars(default).items() if not k.startswith("_")}
    fields.update({k: getattr(default, k) for k in kwargs if k not in fields and hasattr(default, k)})
    fields.update({k: None for k in IMPLEMENTATIONS if hasattr(default, f"_{k}")})
    read = _names_read_by(cls)
    check_options("hf model", name, {**fields, **{k: None for k in kwargs if k not in fields and k in read}}, kwargs,
                  least=0)
    return call_user(f"{name}'s config", make, **kwargs)


def _names_read_by(cls: type) -> set[str]:
    """Every identifier in the source of the module defining ``cls`` (fields a model reads from its
    config without the config declaring them, like T5's ``decoder_start_token_id``)."""
    try:
        return set(re.findall(r"[A-Za-z_]\w*", inspect.getsource(sys.modules[cls.__module__])))
    except (OSError, TypeError, KeyError):
        return set()


def _from_directory(tf: Any, path: str, kwargs: dict) -> Built:
    if not os.path.isdir(path):
        raise UserError(f"hf:{path} is not a directory saved with save_pretrained")
    try:
        saved = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the config in {path}: {e}") from None
    arch = (saved.architectures or [None])[0]
    cls = getattr(tf, arch, None) if arch else None
    if cls is None:
        raise UserError(f"{path}/config.json names no model class (\"architectures\"); save it with save_pretrained")

    def make(**kw: Any) -> Any:
        return tf.AutoConfig.from_pretrained(path, local_files_only=True, **kw)

    def build(cfg: Any) -> nn.Module:
        return cls.from_pretrained(path, config=cfg, local_files_only=True)

    return cls, build, _config(f"hf:{path}", make, kwargs, cls)


def _skeleton(tf: Any, cls: Any, config: Any, path: str | None) -> nn.Module:
    """``cls(config)`` in the dtype ``from_pretrained`` would load it in (the config's, like its
    ``dtype="auto"``), with the directory's generation config: a model to load a state_dict into
    or to save, nothing read."""
    dtype = getattr(config, "dtype", None) if path is not None else None
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    before = torch.get_default_dtype()
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        model = cls(config)
    finally:
        torch.set_default_dtype(before)
    if path is not None and os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = tf.GenerationConfig.from_pretrained(path, local_files_only=True)
    return model


DEEP = 64      # layers above which the parameters are estimated from two shallow copies before any build


def _check_depth(spec: str, cls: Any, config: Any) -> None:
    """UserError (one line) before any build when a config of more than ``DEEP`` layers would not
    fit in memory: its parameter bytes extrapolated from the same config at 1 and 2 layers, built on
    the meta device (building a million layers on the meta device alone takes minutes and gigabytes)."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= DEEP:
        return
    sizes = []
    for n in (1, 2):
        shallow = copy.deepcopy(config)
        try:
            shallow.num_hidden_layers = n
            with torch.device("meta"):
                model = cls(shallow)
        except Exception:       # a config whose other fields follow the depth (per-layer lists): built as given
            return
        sizes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    need = sizes[0] + (layers - 1) * (sizes[1] - sizes[0])
    require_memory(need, f"building {spec} ({layers:,} layers, about {need / 2**30:,.1f} GiB of parameters)",
                   "choose fewer layers or smaller model options")


def _problem_type(config: Any, cls: type) -> None:
    """A sequence or image classifier's ``problem_type`` fixed before capture where the config leaves
    it None, as the model's own first forward would infer it from integer labels (regression for one
    label, else single-label classification; BERT stores it so): DeBERTa's None branch drops
    negative labels with a data-dependent ``nonzero``, which torch.export cannot capture."""
    name = cls.__name__
    if "Classification" in name and "TokenClassification" not in name and getattr(config, "problem_type", 0) is None:
        config.problem_type = "regression" if int(getattr(config, "num_labels", 2)) == 1 else \
            "single_label_classification"


def _forward_args(cls: type) -> set[str]:
    """The argument names ``cls.forward`` declares (a training head declares ``labels``)."""
    return set(inspect.signature(cls.forward).parameters)  # type: ignore[attr-defined]


def _set_dropout(config: Any, p: float) -> None:
    """Every random drop probability of ``config`` (and of its sub-configs: an encoder-decoder's
    or a two-tower model's) set to ``p``: dropout (``hidden_dropout_prob``, ``attn_pdrop``,
    ``embd_drop``), stochastic depth (``drop_path_rate``: BEiT, Swin) and LayerDrop (``layerdrop``,
    ``encoder_layerdrop``), each a float field whose name holds "drop"."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and "drop" in key:
            setattr(config, key, p)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):    # a nested PretrainedConfig
            _set_dropout(value, p)
