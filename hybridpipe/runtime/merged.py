"""The whole model's state from a checkpoint: the stages' files merged into one state_dict and one
name-keyed optimizer state (``merge-checkpoint``; ``--init-from`` reads such a file: runtime/lazy.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridpipe.errors import UserError
from hybridpipe.pipeline.tied import complete_tied
from hybridpipe.runtime.checkpoint_files import load_file, read_manifest, stage_file, step_dir


def merge_stages(root: str | os.PathLike, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """One state_dict of the whole model from every stage file of ``step`` (and the manifest).

    Keys must be disjoint across stages unless they hold equal tensors (a weight shared by two
    stages); anything else is an error naming the key. The replicas of a stage must have saved
    the same weights and buffers (:func:`check_replica_copies`): the file holds replica 0's. A
    tied parameter (the manifest's ``tied`` names) appears under every one of its names, as in
    the unsplit model's ``state_dict``, once its stages' copies are checked to be bit-identical.
    """
    manifest = read_manifest(step_dir(root, step))
    check_replica_copies(manifest, step_dir(root, step))
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for k in range(manifest["n_stages"]):
        state = load_file(root, step, stage_file(k)).get("model")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise UserError(f"{step_dir(root, step) / stage_file(k)} holds no state_dict of tensors under \"model\"")
        for key, value in state.items():
            if key in merged and not torch.equal(merged[key], value):
                raise UserError(f"stages {owner[key]} and {k} both hold {key!r} with different values; "
                                "this checkpoint cannot be merged into one state_dict")
            merged.setdefault(key, value)
            owner.setdefault(key, k)
    return complete_tied(merged, manifest.get("tied", [])), manifest


def check_replica_copies(manifest: dict, where: str | os.PathLike) -> None:
    """UserError unless every replica of each replicated stage reported the same digest for every
    weight and buffer at the save (the manifest's ``replicas``; an older checkpoint has none)."""
    for stage, copies in sorted(manifest.get("replicas", {}).items(), key=lambda kv: int(kv[0])):
        ranks = sorted(copies, key=int)
        first = copies[ranks[0]]
        for rank in ranks[1:]:
            other = copies[rank]
            differ = sorted(n for n in set(first) | set(other) if first.get(n) != other.get(n))
            if differ:
                raise UserError(f"{where}: the replicas of stage {stage} saved different values of {differ[0]!r} "
                                f"(ranks {ranks[0]} and {rank}; {len(differ)} tensor(s) differ), and the checkpoint "
                                "holds only the first one's: it does not hold what the run trained; merge another "
                                "step (and please report this)")


def merge_optimizer(root: str | os.PathLike, step: int) -> dict:
    """The whole model's optimizer state of ``step``, keyed by parameter names (the union of the
    stages' name-keyed states; see runtime/reshard.py)."""
    manifest = read_manifest(step_dir(root, step))
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for k in range(manifest["n_stages"]):
        part = load_file(root, step, stage_file(k)).get("optimizer")
        if not isinstance(part, dict):
            raise UserError(f"{step_dir(root, step) / stage_file(k)} holds no optimizer state")
        out["state"].update(part.get("state", {}))
        out["param_groups"].extend(part.get("param_groups", []))
    return out
