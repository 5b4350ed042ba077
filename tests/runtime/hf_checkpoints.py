"""Checkpoints written by hand in the runtime's format (runtime/checkpoint_files.py: stage files,
manifest, atomic commit), for testing what reads them -- merge-checkpoint, its formats -- without
launching a job: a model's state_dict split into two stage files, a tied weight once."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridpipe.profiles.capture import tied_parameters
from hybridpipe.runtime.checkpoint_files import atomic_save, commit, stage_file, staging_dir, write_manifest
from hybridpipe.runtime.reshard import canonical_names, canonical_state


def write_checkpoint(root: Path, spec: str, model: nn.Module, step: int = 1) -> Path:
    """``model``'s weights as step ``step`` of a two-stage run of ``spec`` under ``root``."""
    tied = tied_parameters(model)
    state = canonical_state(model.state_dict(), canonical_names(tied))
    names = list(state)
    parts = [{k: state[k] for k in names[:len(names) // 2]}, {k: state[k] for k in names[len(names) // 2:]}]
    staging = staging_dir(root, step)
    staging.mkdir(parents=True)
    files = [atomic_save({"model": part, "optimizer": {"state": {}, "param_groups": []}}, staging / stage_file(k))
             for k, part in enumerate(parts)]
    write_manifest(staging, step, files, {"model": spec, "n_stages": 2, "tied": [list(g) for g in tied],
                                          "lineage": "hand-made"})
    final, _ = commit(root, step, {f.name for f in files})
    return final


def perturbed(model: nn.Module, seed: int = 1) -> nn.Module:
    """``model`` with every parameter and floating buffer moved off its initial values (as training
    would), so nothing can pass by being re-initialised the same way."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.01)
    return model
