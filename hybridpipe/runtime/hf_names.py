"""A Hugging Face model's ``save_pretrained`` files seen under the model's own tensor names.

transformers 5 stores some models' weights on disk under other names and shapes than the module
holds them, and ``from_pretrained`` converts on load (transformers' conversion mapping): Swin's
``attention.q_proj.weight`` is ``attention.self.query.weight`` in its files, and Mixtral's (and
every Qwen-MoE-style model's) stacked ``mlp.experts.gate_up_proj`` is read from one ``w1`` and one
``w3`` file tensor per expert under ``block_sparse_moe``. :func:`module_view` applies the same
conversion, by transformers' own rules and operations, tensor by tensor: a rank that reads only its
stages reads only the file tensors those stages' tensors are made from.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from hybridpipe.runtime.tensor_files import Weights


class ConvertedWeights:
    """``files`` (a ``save_pretrained`` directory's tensors) under the names of ``module``'s
    state_dict: a renamed tensor under the module's name, a converted one (merged, concatenated)
    made from its file tensors when read; file tensors that map to nothing keep their own names (a
    reader reports them unexpected)."""

    def __init__(self, files: Weights, module: nn.Module, rules: tuple[list[Any], list[Any]]) -> None:
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        self.files, self.module, self.where = files, module, files.where
        renamings, self._converters = rules
        state = module.state_dict(keep_vars=True)
        self._names: dict[str, str] = {}                             # module name -> file name (renames)
        groups: dict[str, list[tuple[str, str]]] = {}                 # first target -> (file key, pattern)
        for key in sorted(files.keys(), key=dot_natural_key):          # transformers' order (experts 0, 1, ...)
            name, pattern = rename_source_key(key, renamings, self._converters,
                                              getattr(module, "base_model_prefix", None), state)
            if pattern is not None and name in state:
                groups.setdefault(name, []).append((key, pattern))
            else:
                self._names[name if name in state else key] = key
        self._made: dict[str, tuple[str, torch.Size, torch.dtype]] = {}   # target -> (group, shape, dtype)
        self._groups = groups
        self._ready: dict[str, torch.Tensor] = {}
        for first, members in groups.items():
            for target, t in self._convert(first, members, meta=True).items():
                self._made[target] = (first, t.shape, t.dtype)

    def keys(self) -> list[str]:
        return [*self._names, *self._made]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._made[name][1]) if name in self._made else self.files.shape(self._names[name])

    def dtype(self, name: str) -> torch.dtype:
        return self._made[name][2] if name in self._made else self.files.dtype(self._names[name])

    def get(self, name: str) -> torch.Tensor:
        if name not in self._made:
            return self.files.get(self._names[name])
        if name not in self._ready:         # a converter making several targets reads its files once
            first = self._made[name][0]
            self._ready.update(self._convert(first, self._groups[first], meta=False))
        return self._ready.pop(name)

    def _convert(self, first: str, members: list[tuple[str, str]], meta: bool) -> dict[str, torch.Tensor]:
        """The tensors transformers' converter makes from ``members`` (file key, source pattern), on
        the meta device (shapes and dtypes only: no file is read) or read."""
        converter = copy.deepcopy(next(c for c in self._converters if members[0][1] in c.source_patterns))
        for key, pattern in members:
            t = (torch.empty(self.files.shape(key), dtype=self.files.dtype(key), device="meta") if meta
                 else self.files.get(key))
            converter.add_tensor(first, key, pattern, t)
        made = converter.convert(first, model=self.module, config=getattr(self.module, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in made.items()}


def module_view(files: Weights, module: nn.Module) -> Weights:
    """``files`` under ``module``'s names where transformers converts them on load (a Hugging Face
    model with a conversion mapping); ``files`` as they are for any other module."""
    rules = _rules(module)
    return ConvertedWeights(files, module, rules) if rules is not None else files


def _rules(module: nn.Module) -> tuple[list[Any], list[Any]] | None:
    """(renamings, converters) ``from_pretrained`` applies to ``module``'s files, or None."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    if not isinstance(module, PreTrainedModel):
        return None
    mapping = get_model_conversion_mapping(module)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return (renamings, converters) if renamings or converters else None
