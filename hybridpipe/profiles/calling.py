"""How hybridpipe calls a model: a batch as ``forward``'s arguments, the loss a model computed
itself, the switches that training does not need, the autocast it runs under.

The example input (and every batch) is a tensor (called as ``model(x)``), a tuple or list
(``model(*x)``) or a dict (``model(**x)``), nested structures allowed. A forward that takes
``use_cache`` gets ``use_cache=False`` (a Hugging Face model would otherwise return a key/value
cache that nothing can carry).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def call_args(batch: Any) -> tuple[tuple, dict]:
    """How a batch is passed to ``forward``: a tensor as ``(x,)``, a tuple/list as ``*x``, a dict as ``**x``."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        return tuple(batch), {}
    return (batch,), {}


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself (``output.loss`` or ``output["loss"]``), else None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def training_switches(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments that switch off what training does not need (a Hugging Face KV cache)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def autocast_context(model: nn.Module, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on the device of ``model``'s first parameter (or buffer, else
    the CPU); nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    return torch.autocast(device.type, dtype=dtype)
