"""Each rank builds only its own stages of a model whose weights come from its seeded initialisation
(the zoo, ``hf:NAME[...]`` configs, a user's factory: no weights' files).

One process runs ``torch.manual_seed(seed); model = build()``. Here every rank builds the model with
its parameters on the meta device (:func:`capture_unbuilt`: no memory, no initialisation work) and
captures it there: the graph, blocks and plan checks are those of the whole model. Once the rank
knows its stages, :func:`build_stages` builds the model again from the same seed holding only
their parameters (profiles/replay.py: every random draw of the other parameters is made on a
scratch tensor and freed, so the kept ones get one process's values bitwise) and puts their
parameters and buffers in place of the meta ones in the model and its graph. A rank's memory is
its stages' weights, the model's buffers, the largest single parameter (a scratch tensor, freed)
and what the process holds anyway.

Where that cannot be guaranteed, the whole model is built, with one log line saying why:
a model that cannot be built or captured with its parameters on the meta device (every rank
builds it whole, as before); a construction that does not replay a part at a time (it reads a
value of a parameter that is not kept, registers parameters in another order: the rank builds the
whole model and takes its stages' values from it); and, checked across ranks by
:func:`agree`, a construction whose random draws depend on which parameters are kept (the ranks'
digests differ: every rank builds the whole model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.plancheck import CheckedPlan, check_plan
from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.capture import CapturedModel, capture_model
from hybridpipe.profiles.capture_cache import CaptureCache
from hybridpipe.profiles.meta import capture_on_meta, parameters_on_meta, replace_tensors
from hybridpipe.profiles.replay import NotReplayable, build_part, registration_names
from hybridpipe.profiles.zoo import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class Recipe:
    """How one process builds the model: ``torch.manual_seed(seed); build()``, and what a build
    with its parameters on the meta device recorded (each registered parameter's names, shape and
    dtype: profiles/replay.py)."""

    name: str
    build: Callable[[], nn.Module]
    seed: int
    registrations: list[tuple[str, ...]]
    shapes: list[tuple[tuple[int, ...], torch.dtype]]


def capture_unbuilt(spec: ModelSpec, example: Any, plan: Plan, seed: int, *, cache: CaptureCache | None = None,
                    autocast: torch.dtype | None = None) -> tuple[nn.Module, CapturedModel, CheckedPlan, Recipe] | None:
    """The spec's model with its parameters on the meta device, its capture (under ``torch.autocast``
    to ``autocast`` if given; through ``cache``: a
    restarted worker reads it, profiles/capture_cache.py), the plan checked against it
    (pipeline/plancheck.py), and the recipe :func:`build_stages` replays; None when the build
    leaves no parameter on the meta device (a module given already built), or (logged) when it
    cannot be built or captured that way. The global random state is left as
    ``torch.manual_seed(seed)`` leaves it."""
    why = "it cannot be built and captured with its parameters on the meta device"
    try:
        torch.manual_seed(seed)
        with parameters_on_meta() as registered:
            module = spec.build()
        if not any(p.is_meta for p in module.parameters()):
            return None
        recipe = Recipe(spec.name, spec.build, seed, registration_names(module, registered),
                        [(tuple(p.shape), p.dtype) for p in registered])
        captured = capture_on_meta(module, example, granularity=plan.granularity, leaf_modules=spec.leaf_modules,
                                   capture=cache.capture if cache is not None else capture_model, autocast=autocast)
        why = "captured with its parameters on the meta device it does not fit the plan"
        try:
            checked = check_plan(captured, plan)
        except UserError as e:      # a plan for another model: the whole build says so in its one line
            log.info("hybridpipe: every rank builds the whole of %s: %s (%s)", spec.name, why, _first_line(e))
            return None
    except Exception as e:      # noqa: BLE001 - any failure here is retried the whole way, which reports it
        log.warning("hybridpipe: every rank builds the whole of %s: %s (%s: %s)", spec.name, why, type(e).__name__,
                    _first_line(e))
        return None
    finally:
        torch.manual_seed(seed)
    return module, captured, checked, recipe


def build_stages(module: nn.Module, captured: CapturedModel, recipe: Recipe, plan: Plan,
                 stages: Iterable[int], *, whole: bool = False) -> str:
    """Give the parameters and buffers of ``stages`` in ``module`` and its graph one process's
    values, from a build holding only them (see the module docstring), or from the whole model
    when ``whole`` or when the construction does not replay; the digest of the construction's
    random draws ("" when the rank built the whole model)."""
    ranges = [(s.first_node, s.last_node) for s in plan.stages]
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    own = {id(t) for t in module.buffers()} | names.keys()    # not the constants the graph holds itself
    wanted: dict[int, tuple[str, torch.Tensor]] = {}
    for index in stages:
        stage = build_stage_index(captured, ranges, index).module
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            if id(t) in own:
                wanted.setdefault(id(t), (name, t))
    source, digest = None, ""
    if not whole:
        keep = {n for key in wanted for n in names.get(key, ())}
        try:
            part = build_part(recipe.build, recipe.seed, keep, recipe.registrations, recipe.shapes)
            source, digest = part.module, part.digest
        except NotReplayable as e:
            log.warning("hybridpipe: this rank builds the whole of %s for its stages' values: its initialisation "
                        "cannot be replayed a part at a time (%s)", recipe.name, e)
    if source is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            source = recipe.build()
    new = {key: source.get_parameter(name) if isinstance(old, nn.Parameter) else source.get_buffer(name)
           for key, (name, old) in wanted.items()}
    replace_tensors([module, captured.graph], new)
    return digest


def materialize_seeded(module: nn.Module, captured: CapturedModel, recipe: Recipe, plan: Plan,
                       stages: Iterable[int]) -> None:
    """:func:`build_stages`, then every rank builds the whole model instead when the ranks'
    constructions drew different random numbers (:func:`agree`; said in one log line)."""
    stages = list(stages)
    if not agree(build_stages(module, captured, recipe, plan, stages)):
        log.warning("hybridpipe: every rank builds the whole of %s: its initialisation draws other random numbers "
                    "when only a stage is kept (it depends on which parameters are on the meta device)", recipe.name)
        build_stages(module, captured, recipe, plan, stages, whole=True)


def agree(digest: str) -> bool:
    """Whether every rank's construction drew the same random numbers (one all-gather over the
    default group; True without one). A rank that built the whole model ("") agrees with any."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    return len({d for d in everyone if d}) <= 1


def _first_line(e: BaseException) -> str:
    text = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return text[:200]
