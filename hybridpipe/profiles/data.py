"""Training data: synthetic by default (as in the papers), or the user's map-style Dataset.

``resolve_dataset("synthetic", model, size=N, seed=S)`` gives samples that depend only on
``(seed, index)``, so every rank and every run sees the same data without any I/O. Targets
are a fixed function of the input (the same for every seed), so a model can learn them and
the loss goes down:

* one class id per sample: argmax of a fixed random projection of the input, average-pooled
  to ``FEATURES`` numbers;
* one class id per token (integer inputs with targets shaped like the input, e.g. ``gpt``): a
  fixed random permutation of the vocabulary applied token by token;
* any other target shape: class ids drawn from the sample's own generator (not learnable).

``resolve_dataset("package.module:factory[k=v]", ...)`` imports the factory, calls it with the
keyword arguments and checks that it returned a map-style Dataset of (input, target) pairs
whose input matches the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.nn import functional as F
from torch.utils.data import Dataset

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo.spec import ModelSpec, batch_rows, call_user, import_factory, parse_spec

FEATURES = 64          # pooled input features the class-id projection reads
_TASK_SEED = 0x5EED    # the target function is the same for every data seed


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A torch generator seeded from ``(seed, index)`` (no collisions between nearby pairs)."""
    state = np.random.SeedSequence((seed, index)).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class SyntheticDataset(Dataset):
    """``size`` samples of a model's input shape and dtype; sample i depends only on (seed, i)."""

    def __init__(self, sample_shape: tuple[int, ...], input_dtype: torch.dtype, target_shape: tuple[int, ...],
                 num_classes: int, *, size: int, seed: int = 0):
        if size < 1:
            raise UserError(f"a synthetic dataset needs size >= 1, got {size}")
        self.sample_shape, self.input_dtype = tuple(sample_shape), input_dtype
        self.target_shape, self.num_classes = tuple(target_shape), max(int(num_classes), 1)
        self.size, self.seed = size, seed
        task = torch.Generator().manual_seed(_TASK_SEED)
        self.projection = torch.randn(self.num_classes, FEATURES, generator=task)
        self.permutation = torch.randperm(self.num_classes, generator=task)

    @classmethod
    def for_model(cls, model: ModelSpec, *, size: int, seed: int = 0) -> Dataset:
        """The model's own synthetic samples (``ModelSpec.sample``) if it has them, else this class's."""
        if model.sample is not None:
            return SampledDataset(model.sample, size=size, seed=seed)
        return cls(model.sample_shape, model.input_dtype, model.target_shape, model.num_classes,
                   size=size, seed=seed)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} outside 0..{self.size - 1}")
        g = sample_generator(self.seed, index)
        if self.input_dtype.is_floating_point:
            x = torch.randn(self.sample_shape, generator=g).to(self.input_dtype)
        else:
            x = torch.randint(0, self.num_classes, self.sample_shape, generator=g, dtype=self.input_dtype)
        return x, self._target(x, g)

    def _target(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if self.target_shape == ():
            pooled = F.adaptive_avg_pool1d(x.float().reshape(1, 1, -1), FEATURES).reshape(FEATURES)
            return (self.projection @ pooled).argmax()
        if not x.is_floating_point() and self.target_shape == tuple(x.shape):
            return self.permutation[x.long().clamp(0, self.num_classes - 1)]
        return torch.randint(0, self.num_classes, self.target_shape, generator=g)


class SampledDataset(Dataset):
    """``size`` samples drawn by a model's sample function; sample i depends only on (seed, i)."""

    def __init__(self, sample: Callable[[torch.Generator], Any], *, size: int, seed: int = 0):
        if size < 1:
            raise UserError(f"a synthetic dataset needs size >= 1, got {size}")
        self.sample, self.size, self.seed = sample, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} outside 0..{self.size - 1}")
        return self.sample(sample_generator(self.seed, index))


def resolve_dataset(spec: str, model: ModelSpec, *, size: int, seed: int = 0) -> Dataset:
    """``"synthetic"`` or ``"package.module:factory[k=v,...]"`` -> a map-style Dataset of (input, target).

    ``size`` and ``seed`` shape the synthetic data; a user's dataset has its own length.
    """
    if spec == "synthetic":
        return SyntheticDataset.for_model(model, size=size, seed=seed)
    target, kwargs = parse_spec(spec, what="dataset")
    if ":" not in target:
        raise UserError(f"unknown dataset {spec!r}: use \"synthetic\" or package.module:factory")
    factory = import_factory(target, "dataset")
    who = f"your dataset factory `{target}`"
    dataset = call_user(who, factory, **kwargs)
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(f"{target} must return a map-style Dataset (with __getitem__ and __len__), "
                        f"got {type(dataset).__name__}")
    n = call_user(f"len() of your dataset from `{target}`", len, dataset)
    if n < 1:
        raise UserError(f"the dataset from {target} is empty")
    check_sample(call_user(f"your dataset from `{target}` (reading sample 0)", dataset.__getitem__, 0), model, target)
    return dataset


def check_sample(sample: object, model: ModelSpec, source: str) -> None:
    """Refuse a dataset whose first sample is not ``(input, target)`` with the model's input shape
    (a tuple or dict input: its example's structure), or, for a model that computes its own loss,
    not an input shaped like its example."""
    if model.loss is None:
        if batch_rows(model.example_input(1)) is not None and not _same_structure(sample, model):
            raise UserError(f"{source}: a sample must be one input of {model.name} (its keys/structure: "
                            f"{_describe(model.example_input(1))}), got {_describe(sample)}")
        return
    if model.example is not None and not isinstance(model.example, torch.Tensor):     # a tuple or dict input
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2 and _same_structure(sample[0], model)):
            raise UserError(f"{source}: a sample must be a pair (input, target), the input one input of {model.name} "
                            f"(its keys/structure: {_describe(model.example_input(1))}), got {_describe(sample)}")
        return
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], torch.Tensor)):
        raise UserError(f"{source}: a sample must be a pair (input tensor, target), got {type(sample).__name__}")
    shape = tuple(sample[0].shape)
    if shape != tuple(model.sample_shape):
        raise UserError(f"{source}: a sample's input has shape {list(shape)} but {model.name} takes "
                        f"{list(model.sample_shape)} (without the batch dimension)")


def _same_structure(sample: object, model: ModelSpec) -> bool:
    example = model.example_input(1)
    return pytree.tree_structure(sample) == pytree.tree_structure(pytree.tree_map(lambda t: t, example))


def _describe(obj: object) -> str:
    if isinstance(obj, dict):
        return "{" + ", ".join(map(str, obj)) + "}"
    return type(obj).__name__
