"""Weights on disk, read by name: a ``.safetensors`` file, a Hugging Face directory (``save_pretrained``:
``model.safetensors``, or shards listed in ``model.safetensors.index.json``), or a torch file.

    weights = open_weights("out/hf")              # headers only: names, shapes, dtypes
    weights.shape("lm_head.weight"); weights.get("transformer.h.0.attn.c_attn.weight")

A safetensors tensor is read on its own (``safe_open``'s ``pread`` backend: its bytes, nothing
else, no memory map left resident), so a rank that needs a quarter of the model reads a quarter of
the file. A torch file (``torch.save``; read with ``weights_only=True``) is loaded whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import MANIFEST, load_data, step_dirs

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class Weights(Protocol):
    """Named tensors to read one at a time."""

    where: str

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def get(self, name: str) -> torch.Tensor: ...


class StateDictWeights:
    """A state_dict in memory (a torch file's)."""

    def __init__(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        self.state, self.where = dict(state), where

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]


class SafetensorsWeights:
    """One or more safetensors files (a shard per name from an HF index), read a tensor at a time."""

    def __init__(self, files: Mapping[str, Path], where: str) -> None:
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError:
            raise UserError(f"reading {where} needs the safetensors package (pip install safetensors)") from None

        self.where = where
        self.file: dict[str, Path] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for path in dict.fromkeys(files.values()):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        view = f.get_slice(name)
                        self.meta[name] = (tuple(view.get_shape()), _DTYPES[view.get_dtype()])
                        self.file[name] = path
            except OSError as e:
                raise UserError(f"cannot read {path}: {e.strerror or e}") from None
            except (SafetensorError, KeyError) as e:
                raise UserError(f"{path} is not a safetensors file ({e})") from None
        listed = {n for n, p in files.items() if n != "*"}
        absent = sorted(listed - set(self.meta))
        if absent:
            raise UserError(f"{where}: its index lists {absent[0]!r} ({len(absent)} tensor(s)) in a shard that "
                            "does not hold it")

    def keys(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            opened = safe_open(str(self.file[name]), framework="pt", backend="pread")
        except TypeError:                   # a safetensors before the pread backend: its memory map, copied
            with safe_open(str(self.file[name]), framework="pt") as f:
                return f.get_tensor(name).clone()
        with opened as f:
            return f.get_tensor(name)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding safetensors weights as ``save_pretrained`` writes them."""
    p = Path(path)
    return p.is_dir() and ((p / SAFETENSORS).is_file() or (p / SAFETENSORS_INDEX).is_file())


def open_weights(path: str | os.PathLike) -> Weights:
    """The named tensors at ``path``: a ``.safetensors`` file, an HF directory or a torch state_dict
    file (``{"model": state_dict, ...}`` as ``merge-checkpoint --with-optimizer`` writes is read
    by :func:`read_torch_file`)."""
    p = Path(path)
    if p.is_dir():
        if (p / SAFETENSORS_INDEX).is_file():
            return SafetensorsWeights(_index(p), str(p))
        if (p / SAFETENSORS).is_file():
            return SafetensorsWeights({"*": p / SAFETENSORS}, str(p))
        if (p / MANIFEST).is_file() or step_dirs(p):
            raise UserError(f"{p} is a hybridpipe checkpoint directory, which --init-from does not read: continue "
                            f"that run with --resume --checkpoint-dir, or start a new one from it with "
                            f"`hybridpipe merge-checkpoint {p} --with-optimizer -o start.pt` (weights and optimizer "
                            "state; without --with-optimizer the weights) and --init-from start.pt")
        raise UserError(f"{p} holds no {SAFETENSORS} or {SAFETENSORS_INDEX} (a directory written by save_pretrained "
                        "with safetensors, the default)")
    if p.suffix == ".safetensors":
        if not p.is_file():
            raise UserError(f"{p} does not exist")
        return SafetensorsWeights({"*": p}, str(p))
    state, _ = read_torch_file(p)
    return StateDictWeights(state, str(p))


def read_torch_file(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(state_dict, name-keyed optimizer state or None) of a torch file: ``torch.save(model.state_dict())``
    or ``merge-checkpoint``'s (``--with-optimizer``: ``{"model": ..., "optimizer": ...}``)."""
    data = load_data(Path(path))
    state, optimizer = (data.get("model"), data.get("optimizer")) if "model" in data else (data, None)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} holds no state_dict of tensors (expected torch.save(model.state_dict()), a "
                        ".safetensors file, a save_pretrained directory or `hybridpipe merge-checkpoint`'s output)")
    if optimizer is not None and not isinstance(optimizer, dict):
        raise UserError(f"{path}: its \"optimizer\" entry is not an optimizer state")
    return state, optimizer


def _index(directory: Path) -> dict[str, Path]:
    """name -> shard file of an HF sharded checkpoint (``model.safetensors.index.json``)."""
    where = directory / SAFETENSORS_INDEX
    try:
        data = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {where}: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{where} has no \"weight_map\" of tensor name -> shard file")
    out = {}
    for name, shard in weight_map.items():
        file = directory / shard
        if "/" in shard or not file.is_file():
            raise UserError(f"{where} names shard {shard!r}, which is not a file in {directory}")
        out[name] = file
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
