"""A replicated stage's gradient sync as the plan writes it, the launch overrides, and what ran.

* :func:`stage_layers`: the plan's layers for the stage (each layer's algorithm, sync unit and
  lane; checked against the stage's parameters at start-up, pipeline/plancheck.py); or, for a
  plan that lists none for a replicated stage (one written by hand), what ``partition`` would
  have written: the partitioner's policy on the plan's cluster, over the stage's modules.
* :func:`override_layers`: ``--allreduce`` / ``--calibration`` at launch are deliberate overrides:
  the same layers re-decided (one algorithm for all, or the partitioner's policy on a cost model
  with the calibrations), with the same unit and lane rules. :func:`describe_override` is the
  line the stage's first rank prints.
* :func:`unit_choices`: the layers as HybridDataParallel's explicit units (run as given).
* :func:`sync_report`: per layer (the plan's names), the algorithm the all-reduce actually ran,
  as the HybridDataParallel object recorded it, next to the plan's (``summary.json``).

Pure functions but for reading the module's parameters and the HybridDataParallel's record.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from torch import nn

from hybridpipe.comm.hybrid_dp import HybridDataParallel, UnitChoice, model_layers
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.layersync import choose_layer_algorithms
from hybridpipe.partitioner.cost.syncunits import LayerSync, sync_units, with_algorithm
from hybridpipe.partitioner.plan import ALGORITHMS, Stage

SHOWN_CHANGES = 6        # layers named in an override's line before "and N more"


def derived_layers(module: nn.Module, ranks: Sequence[int], model: CostModel,
                   exclude: Collection[nn.Parameter] = ()) -> tuple[LayerSync, ...]:
    """What ``partition`` writes for a stage, over ``module``'s own layers (named by module path)."""
    layers = model_layers(module, exclude)
    zeros = [0.0] * len(layers)
    return choose_layer_algorithms([lv.name for lv in layers], [lv.nbytes for lv in layers], zeros, zeros,
                                   ranks, model, ALGORITHMS, params=[lv.param_names for lv in layers]).layers


def stage_layers(stage: Stage, module: nn.Module, model: CostModel,
                 exclude: Collection[nn.Parameter] = ()) -> tuple[LayerSync, ...]:
    """The plan's layers for ``stage`` (checked against its parameters at start-up:
    pipeline/plancheck.py check_sync_layers), or for a plan that lists none what ``partition``
    would have written, over ``module``'s layers but the ``exclude``d (tied across stages)."""
    return trainable_layers(stage.layers, module) if stage.layers else derived_layers(module, stage.ranks, model,
                                                                                       exclude)


def trainable_layers(layers: Sequence[LayerSync], module: nn.Module) -> tuple[LayerSync, ...]:
    """``layers`` without the parameters ``module`` holds frozen (``requires_grad`` False: no gradient
    to sum), their bytes taken off, a layer left with none dropped: a profile lists every parameter
    its nodes own, so ``partition`` plans a frozen one too (Whisper's sinusoidal position table, a
    fine-tuning's frozen embedding)."""
    frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
    out = []
    for lv in layers:
        kept = tuple(p for p in lv.params if p not in frozen)
        if kept:
            less = sum(frozen[p].numel() * frozen[p].element_size() for p in lv.params if p in frozen)
            out.append(replace(lv, params=kept, bytes=lv.bytes - less))
    return tuple(out)


def override_layers(layers: Sequence[LayerSync], policy: str, ranks: Sequence[int],
                    model: CostModel) -> tuple[LayerSync, ...]:
    """``layers`` re-decided at launch: ``policy`` one algorithm for every layer, or ``hybrid``
    (the partitioner's per-layer policy on ``model``, e.g. with launch's calibrations)."""
    if policy != "hybrid":
        return with_algorithm(layers, policy, ranks, model)
    zeros = [0.0] * len(layers)
    return choose_layer_algorithms([lv.layer for lv in layers], [lv.bytes for lv in layers], zeros, zeros, ranks,
                                   model, ALGORITHMS, params=[lv.params for lv in layers]).layers


def describe_override(stage: int, flags: str, before: Sequence[LayerSync], after: Sequence[LayerSync]) -> str:
    """One line: what the override ``flags`` changed against the plan in ``stage``."""
    changed = [f"{a.layer} {b.algorithm}->{a.algorithm}" for b, a in zip(before, after, strict=True)
               if a.algorithm != b.algorithm]
    parts = []
    if changed:
        more = f" and {len(changed) - SHOWN_CHANGES} more" if len(changed) > SHOWN_CHANGES else ""
        parts.append(f"{len(changed)} of {len(after)} layers change algorithm: "
                     f"{', '.join(changed[:SHOWN_CHANGES])}{more}")
    units = [len(_units(before)), len(_units(after))]
    if units[0] != units[1] or _units(before) != _units(after):
        parts.append(f"sync units {units[0]}->{units[1]}")
    lanes = [sum(lv.lane for lv in before), sum(lv.lane for lv in after)]
    if [lv.lane for lv in before] != [lv.lane for lv in after]:
        parts.append(f"layers on the second lane {lanes[0]}->{lanes[1]}")
    if not parts:
        return f"launch.py: stage {stage}: {flags} changes nothing against the plan ({len(after)} layers)"
    return f"launch.py: stage {stage}: {flags} overrides the plan: {'; '.join(parts)}"


def _units(layers: Sequence[LayerSync]) -> list[tuple[str, ...]]:
    return [tuple(lv.layer for lv in u) for u in sync_units(layers)]


def unit_choices(layers: Sequence[LayerSync]) -> list[UnitChoice]:
    """The layers' sync units as HybridDataParallel's explicit choices."""
    return [UnitChoice(tuple(p for lv in u for p in lv.params), u[0].algorithm, u[0].lane,
                       "+".join(lv.layer for lv in u), sum(lv.predicted_ms for lv in u))
            for u in sync_units(layers)]


def sync_report(sync: object, stage: Stage) -> list[dict] | None:
    """Per layer of the plan's stage: ``{"layer", "algorithm", "planned"}``, the algorithm its
    all-reduce last ran (from ``sync``, the HybridDataParallel that ran; several joined by '+'
    where a layer's parameters ran different ones, None where none ran) and the plan's (None when
    the plan lists no layers: then the layers are the stage's modules). None for an unreplicated stage."""
    if not isinstance(sync, HybridDataParallel):
        return None
    ran = sync.algorithms_run
    layers: list[tuple[str, tuple[str, ...], str | None]]
    if stage.layers:
        synced = {n for u in sync.units for n in u.param_names}       # frozen parameters are not (trainable_layers)
        layers = [(lv.layer, kept, lv.algorithm) for lv in stage.layers
                  if (kept := tuple(p for p in lv.params if p in synced))]
    else:
        layers = [(layer.name, layer.param_names, None) for u in sync.units for layer in u.layers]
    out = []
    for name, params, planned in layers:
        algorithms = sorted({ran[p] for p in params if p in ran})
        out.append({"layer": name, "algorithm": "+".join(algorithms) or None, "planned": planned})
    return out
