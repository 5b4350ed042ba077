"""Each rank reads only its own stages' weights, for a model whose weights all come from files.

A model spec that names its weights (``hf:DIR``: the ``save_pretrained`` directory) is built with
its parameters on the meta device and captured there (profiles/meta.py): no weight is read and the
graph, blocks and plan checks are those of the whole model. The Trainer then calls
:func:`materialize` with the rank's stages, before it builds them: each parameter and saved buffer
those stages hold is read by name from the files (runtime/tensor_files.py) and put in place of its
meta tensor in the model and its graph. The other stages' tensors are never read, so a rank's
memory is its stages' weights plus what the process holds anyway.

The values are ``from_pretrained``'s: the files' tensors (a tied weight from whichever of its
names the files hold), cast to the dtype the model was built in as ``from_pretrained`` casts them
(a bf16 checkpoint into float32 weights: ``hf:DIR[dtype=float32]``), and the buffers no file holds
(``persistent=False``: rotary frequencies) as the constructor computes them. A model that the
files do not cover (a missing or reshaped tensor, a non-float one of another dtype, which
``from_pretrained`` would initialise or convert), or that cannot be captured on the meta device,
is loaded whole on every rank as before, with one log line saying why.

``--init-from FILE`` (:func:`load_initial`) replaces the files a lazily built model reads, or loads
into a whole model; FILE is a torch state_dict (or ``merge-checkpoint``'s file with the optimizer
state), a ``.safetensors`` file or a ``save_pretrained`` directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.plancheck import CheckedPlan, check_plan
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.pipeline.tied import complete_tied
from hybridpipe.profiles.capture import CapturedModel, capture_model, tied_parameters
from hybridpipe.profiles.capture_cache import CaptureCache
from hybridpipe.profiles.meta import capture_on_meta, parameters_on_meta, replace_tensors
from hybridpipe.profiles.zoo import ModelSpec
from hybridpipe.runtime.hf_names import module_view
from hybridpipe.runtime.tensor_files import Weights, open_weights, read_torch_file

log = logging.getLogger(__name__)


def capture_lazily(spec: ModelSpec, example: Any, plan: Plan, weights: Weights, *, cache: CaptureCache | None = None,
                   autocast: torch.dtype | None = None
                   ) -> tuple[nn.Module, CapturedModel, CheckedPlan, Weights] | None:
    """The spec's model with its parameters on the meta device, its capture (under ``torch.autocast``
    to ``autocast`` if given; through ``cache``, profiles/capture_cache.py), the plan checked
    against it (pipeline/plancheck.py) and ``weights`` under the model's names (runtime/hf_names.py);
    None (logged) when ``weights`` do not cover it or it cannot be captured that way."""
    try:
        with parameters_on_meta():
            module = (spec.skeleton or spec.build)()
        weights = module_view(weights, module)
        why = uncovered(module, weights)
        if not why:
            captured = capture_on_meta(module, example, granularity=plan.granularity,
                                       leaf_modules=spec.leaf_modules,
                                       capture=cache.capture if cache is not None else capture_model,
                                       autocast=autocast)
            return module, captured, check_plan(captured, plan), weights
    except Exception as e:      # noqa: BLE001 - any failure here is retried the whole way, which reports it
        why = f"it cannot be captured without its weights ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    log.warning("hybridpipe: every rank loads the whole of %s: %s", spec.name, why)
    return None


def uncovered(module: nn.Module, weights: Weights) -> str:
    """Why ``weights`` cannot give every saved tensor of ``module`` its value as it stands ("" if they can)."""
    aliases = _aliases(module)
    held = set(weights.keys())
    for name, t in module.state_dict(keep_vars=True).items():
        key = next((a for a in aliases.get(name, (name,)) if a in held), None)
        if key is None:
            return f"{weights.where} holds no {name!r}"
        if weights.shape(key) != tuple(t.shape):
            return f"{key!r} in {weights.where} has shape {weights.shape(key)}, the model {tuple(t.shape)}"
        if weights.dtype(key) != t.dtype and not (weights.dtype(key).is_floating_point and t.dtype.is_floating_point):
            return f"{key!r} in {weights.where} is {weights.dtype(key)}, the model {t.dtype}"
    return ""


def materialize(module: nn.Module, captured: CapturedModel, weights: Weights, plan: Plan,
                stages: Iterable[int]) -> int:
    """Read the parameters and saved buffers of ``stages`` from ``weights`` into ``module`` and its
    graph (in place of their meta tensors, or over the constructor's buffers); the bytes read."""
    ranges = [(s.first_node, s.last_node) for s in plan.stages]
    aliases = _aliases(module)
    held = set(weights.keys())
    own = {id(t) for t in [*module.parameters(), *module.buffers()]}    # not the graph's own constants
    wanted: dict[int, tuple[str, torch.Tensor]] = {}
    for index in stages:
        stage = build_stage_index(captured, ranges, index).module
        saved = set(stage.state_dict(keep_vars=True))
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            if name in saved and id(t) in own:
                wanted.setdefault(id(t), (name, t))
    new: dict[int, torch.Tensor] = {}
    for key, (name, old) in wanted.items():
        source = next((a for a in aliases.get(name, (name,)) if a in held), None)
        if source is None:
            raise UserError(f"{weights.where} holds no {name!r}, which stage(s) {sorted(stages)} need")
        value = weights.get(source)
        if tuple(value.shape) != tuple(old.shape):
            raise UserError(f"{source!r} in {weights.where} has shape {tuple(value.shape)}, the model "
                            f"{tuple(old.shape)}")
        value = value.to(old.dtype)
        new[key] = nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value
    replace_tensors([module, captured.graph], new)
    return sum(t.numel() * t.element_size() for t in new.values())


def load_initial(path: str | os.PathLike, module: nn.Module) -> tuple[Weights, dict | None]:
    """``launch --init-from``: the weights at ``path`` (a state_dict or ``merge-checkpoint`` torch file,
    a ``.safetensors`` file or a ``save_pretrained`` directory), checked to fit ``module`` exactly
    (every saved name, a tied weight under any of its names, every shape), and the name-keyed
    optimizer state the file holds (``merge-checkpoint --with-optimizer``), if any."""
    p = os.fspath(path)
    is_torch = not (os.path.isdir(p) or p.endswith(".safetensors"))
    optimizer = None
    if is_torch:
        from hybridpipe.runtime.tensor_files import StateDictWeights

        state, optimizer = read_torch_file(path)        # type: ignore[arg-type]
        complete_tied(state, tied_parameters(module))    # a tied weight's copies must be identical
        weights: Weights = StateDictWeights(state, p)
    else:
        weights = module_view(open_weights(path), module)     # a save_pretrained directory's names converted
    aliases = _aliases(module)
    held = set(weights.keys())
    expected = module.state_dict(keep_vars=True)
    names_of = {a for names in aliases.values() for a in names}
    missing = [k for k in expected if not any(a in held for a in aliases.get(k, (k,)))]
    unexpected = [k for k in held if k not in expected and k not in names_of]
    shapes = [k for k in held if k in expected and weights.shape(k) != tuple(expected[k].shape)]
    if missing or unexpected or shapes:
        what = (f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}" if unexpected
                else f"{shapes[0]!r} has shape {weights.shape(shapes[0])}, not {tuple(expected[shapes[0]].shape)}")
        raise UserError(f"--init-from {path} does not fit the model ({what}; {len(missing)} missing, "
                        f"{len(unexpected)} unexpected, {len(shapes)} of another shape): it holds another model")
    return weights, optimizer


def load_whole(module: nn.Module, weights: Weights) -> None:
    """Load every saved tensor of ``module`` from ``weights`` (checked by :func:`load_initial`), strictly."""
    aliases = _aliases(module)
    held = set(weights.keys())
    state = {}
    for name in module.state_dict():
        state[name] = weights.get(next(a for a in aliases.get(name, (name,)) if a in held))
    module.load_state_dict(state, strict=True)


def _aliases(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of a tied parameter -> all its names (the others are absent: one name each)."""
    return {name: names for names in tied_parameters(module) for name in names}
