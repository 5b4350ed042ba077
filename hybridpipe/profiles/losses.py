"""The loss contract: what a loss function returns, and how a step's loss is normalized.

A loss function ``loss_fn(output, target)`` gets the model's output as its forward returns it (a
tensor, tuple, dict or ``ModelOutput``) and one micro-batch's target as the data gives it (any
tensor, tuple or dict). It returns either

* the micro-batch's **mean** loss, a scalar tensor; or
* a pair ``(loss_sum, count)``: the per-item (per-token) losses summed over the micro-batch and how
  many items were summed (a tensor or a number), e.g. for a token-level loss with -100 labels::

      def loss_fn(output, labels):
          logits = output.logits.flatten(0, 1)
          total = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
          return total, (labels != -100).sum()

**Loss normalization** (``--loss-normalization``, ``Trainer(loss_normalization=...)``, recorded in
the plan): ``micro-batch`` (the default) makes a step's loss the mean of its micro-batches' mean
losses (a pair counts as ``loss_sum / count``, and as 0 with count 0: an all-padding micro-batch adds
no loss and no gradient): what one process computes with gradient accumulation over equal
micro-batches. ``tokens`` makes it the sum of every micro-batch's ``loss_sum`` (all replicas)
divided by the sum of their counts: what one process computes on the whole global batch at once,
however the valid tokens spread over the micro-batches. It needs the
pair form, or a model that computes its own mean loss over ``labels`` that hybridpipe can count
(:func:`label_counter`: Hugging Face models; labels != -100, shifted by one for causal LMs).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.loss_normalization import LOSS_NORMALIZATIONS as LOSS_NORMALIZATIONS  # re-exported

IGNORE_INDEX = -100         # the label of a token no loss is computed on (torch's and Hugging Face's default)

LossValue = Any             # a scalar tensor (mean) or (loss_sum, count)


def is_pair(value: LossValue) -> bool:
    """Whether a loss function returned ``(loss_sum, count)``."""
    return isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor)


def loss_mean(value: LossValue) -> torch.Tensor:
    """A loss value as the micro-batch's mean: the tensor itself, or ``loss_sum / count``; a pair
    counting nothing (an all-padding micro-batch) adds nothing: 0, with zero gradients, as the
    gradient accumulation loop that skips it computes (its 0 / 0 was a NaN that stopped the run).
    No host sync: the choice is made on the device."""
    if is_pair(value):
        total, count = value
        count = torch.as_tensor(count, device=total.device).to(total.dtype)
        counted = count > 0
        return total / torch.where(counted, count, torch.ones_like(count)) * counted
    return value


def as_mean(fn: Callable[..., LossValue]) -> Callable[..., torch.Tensor]:
    """``fn`` returning the micro-batch's mean loss whichever form it returns (see the module docstring)."""
    def mean(*args: Any, **kwargs: Any) -> torch.Tensor:
        return loss_mean(fn(*args, **kwargs))
    return mean


def pair_counted(value: LossValue) -> torch.Tensor | None:
    """For a ``(loss_sum, count)`` pair, whether it counted anything (a bool tensor, no host sync);
    None for a mean."""
    if not is_pair(value):
        return None
    total, count = value
    return torch.as_tensor(count, device=total.device) > 0


def loss_pair(value: LossValue) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)`` of a loss function's pair, the count a float64 tensor on the sum's
    device; a UserError for any other value (``tokens`` normalization needs the count)."""
    if not is_pair(value):
        got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserError(f"with --loss-normalization tokens the loss function must return (loss_sum, count), the "
                        f"per-token losses summed over the micro-batch and how many tokens it summed; it returned "
                        f"{got} (or use --loss-normalization micro-batch)")
    total, count = value
    count = torch.as_tensor(count, device=total.device).detach().to(torch.float64)
    if total.dim() != 0 or count.dim() != 0:
        raise UserError(f"the loss function's (loss_sum, count) must be two scalars; got shapes {list(total.shape)} "
                        f"and {list(count.shape)}")
    return total, count


def count_labels(batch: Any, *, shift: bool) -> torch.Tensor:
    """How many labels of an input batch a Hugging Face loss averages over: entries of
    ``batch["labels"]`` that are not -100, without the first position of each row for a causal LM
    (it predicts token t+1 from tokens up to t), or of ``batch["shift_labels"]`` as given."""
    if isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        raise UserError("--loss-normalization tokens counts the labels of a model that computes its own loss, but "
                        "the batch has no \"labels\" tensor; give the model's factory a loss function returning "
                        "(loss_sum, count), or use --loss-normalization micro-batch")
    if shift:
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def label_counter(model: nn.Module) -> Callable[[Any], torch.Tensor] | None:
    """For a model that computes its own mean loss from ``labels``, the number of items that mean
    is over in one input batch (:func:`count_labels`); None for a model whose loss hybridpipe
    cannot count (not a Hugging Face ``PreTrainedModel``)."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return None
    shift = _is_causal_lm(type(model).__name__)

    def count(batch: Any) -> torch.Tensor:
        return count_labels(batch, shift=shift)
    return count


def batch_coupled_terms(model: nn.Module) -> list[str]:
    """The terms a Hugging Face model adds to its own loss that are not a sum over its items: a
    mixture of experts' router losses (``output_router_logits`` with a non-zero
    ``router_aux_loss_coef`` or ``router_z_loss_coef``), computed over the batch the forward gets.
    On micro-batches they are one process's with gradient accumulation, never the global batch's."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return []
    return [f"{name}={getattr(config, name)}" for name in ("router_aux_loss_coef", "router_z_loss_coef")
            if getattr(config, name, 0)]


def _is_causal_lm(name: str) -> bool:
    """Whether a Hugging Face model class predicts the next token (shifts its labels by one)."""
    if name.endswith("ForCausalLM"):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        if name == value or (isinstance(value, (tuple, list)) and name in value):
            return True
    return False
