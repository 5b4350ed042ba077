"""Plan-independent checkpoint state: the model's own names instead of stage or optimizer indices.

A checkpoint holds each stage's weights and optimizer state under the *model's* names (the
stage modules' state_dict keys are the unsplit model's names), so any plan of the same model
can pick the names it needs from whichever stage files hold them (:func:`pick`):

* a tied parameter (one Parameter registered under several names, possibly read by several
  stages) is stored once under its *canonical* name (its first name in ``named_parameters``):
  :func:`canonical_names` maps every alias to it;
* optimizer state is converted between torch's index-keyed form (``{"state": {0: ...},
  "param_groups": [{"params": [0, 1], ...}]}``) and a name-keyed one (:func:`named_optimizer_state`,
  :func:`indexed_optimizer_state`), as torch.distributed.checkpoint's get/set_optimizer_state_dict
  do, so SGD momentum and Adam moments land on the same parameters in any other split.

Pure functions over plain data (no files, no processes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError


def canonical_names(tied: Iterable[Sequence[str]]) -> dict[str, str]:
    """alias -> canonical name (the group's first) for every group of names of one parameter."""
    return {name: names[0] for names in tied for name in names}


def canonical_state(state: Mapping[str, torch.Tensor], canon: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state`` keyed by canonical names (the aliases of one tied parameter collapse to one key)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        out.setdefault(canon.get(key, key), value)
    return out


def optimizer_names(optimizer: Any, module: nn.Module, canon: Mapping[str, str]) -> list[str]:
    """The canonical name of each parameter the optimizer holds, in its state_dict's index order."""
    name_of: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), canon.get(name, name))
    names = []
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that the stage module does not")
            names.append(name_of[id(p)])
    return names


def named_optimizer_state(indexed: Mapping[str, Any], names: Sequence[str]) -> dict:
    """torch's index-keyed optimizer state_dict -> the same keyed by parameter names."""
    if not indexed:
        return {"state": {}, "param_groups": []}
    state = {names[int(i)]: dict(s) for i, s in indexed["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
              for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}


def indexed_optimizer_state(named: Mapping[str, Any], names: Sequence[str], current: Mapping[str, Any], *,
                            saved_hyperparameters: bool = False) -> dict:
    """A name-keyed optimizer state (possibly the union of several stages') -> the index-keyed
    state_dict of an optimizer over ``names`` whose own state_dict is ``current`` (its param
    groups are kept). Every name must be one the saved optimizer held. The hyperparameters are
    ``current``'s (a new run started from the state: ``--init-from``), or with
    ``saved_hyperparameters`` the checkpoint's, as torch's ``load_state_dict`` restores them (a
    resumed run: a scheduler may have moved more than the learning rate, e.g. OneCycleLR's betas)."""
    if not names:
        return dict(current)
    saved_groups = named.get("param_groups", [])
    held = {n for g in saved_groups for n in g["params"]}
    missing = [n for n in names if n not in held]
    if missing:
        raise UserError(f"the checkpoint holds no optimizer state for {missing[0]!r} ({len(missing)} parameter(s)): "
                        "it was written for another model")
    state = {i: dict(named["state"][n]) for i, n in enumerate(names) if n in named["state"]}
    groups = [dict(g) for g in current["param_groups"]]
    if saved_hyperparameters:
        hyper_of = {n: {k: v for k, v in g.items() if k != "params"} for g in saved_groups for n in g["params"]}
        for group in groups:
            found = [hyper_of[names[int(i)]] for i in group["params"]]
            if any(not _same_values(h, found[0]) for h in found[1:]):
                raise UserError(f"the optimizer's parameter group of {names[int(group['params'][0])]!r} holds "
                                "parameters that were in groups of other hyperparameters when the checkpoint was "
                                "written: resume with the parameter groups it was written with")
            if found:
                group.update(found[0])
    return {"state": state, "param_groups": groups}


def _same_values(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two param groups' hyperparameters are equal (tensor values, e.g. a tensor lr, compared by value)."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and torch.equal(v, w)):
                return False
        elif v != w:
            return False
    return True


def merge_named(parts: Iterable[Mapping[str, Any]]) -> dict:
    """The union of several name-keyed optimizer states (each name in one of them)."""
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in parts:
        out["state"].update(part.get("state", {}))
        out["param_groups"].extend(part.get("param_groups", []))
    return out


def restrict_named(named: Mapping[str, Any], keep: Iterable[str]) -> dict:
    """``named`` with only the parameters in ``keep`` (groups left empty are dropped)."""
    keep = set(keep)
    groups = [{**g, "params": [n for n in g["params"] if n in keep]} for g in named.get("param_groups", [])]
    return {"state": {n: s for n, s in named.get("state", {}).items() if n in keep},
            "param_groups": [g for g in groups if g["params"]]}


def pick(index: Mapping[str, str], needed: Iterable[str]) -> dict[str, list[str]]:
    """file -> the needed names it holds, from the manifest's ``index`` (name -> file); a name
    no file holds is a UserError (a checkpoint of another model)."""
    out: dict[str, list[str]] = {}
    missing = []
    for name in needed:
        if name in index:
            out.setdefault(index[name], []).append(name)
        else:
            missing.append(name)
    if missing:
        raise UserError(f"the checkpoint holds no {missing[0]!r} ({len(missing)} name(s) missing): it was "
                        "written for another model; resume with that model or pass another --checkpoint-dir")
    return out


def tensor_digest(values: Iterable[Any]) -> str:
    """SHA-256 over the tensors (in order) found in ``values`` (nested dicts and lists)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    for v in values:
        walk(v)
    return h.hexdigest()
