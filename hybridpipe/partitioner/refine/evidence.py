"""What refinement's runs say against the cost model, run by run (refinement.py fits it): the p2p
transfers' measured / predicted ratios per level, each stage's compute and link bytes (the
interference fit's evidence, and the runs with that loss taken out), each stage's measured ``step``
phase against the optimizer step and tied sums the model prices, and the measured stages grouped by
their runs' layouts (the node factors' evidence). Pure functions of plain numbers."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.planner import priced_tied
from hybridpipe.partitioner.refine.interference import StageLoad, link_bytes
from hybridpipe.partitioner.refine.observed import RunObservation
from hybridpipe.partitioner.refine.step import StepStage, TiedEvidence
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec
from hybridpipe.profiles.format import Profile


def p2p_factors(runs: Sequence[RunObservation], model: CostModel) -> tuple[tuple[int, float], ...]:
    """Per level, measured / predicted over the runs' transfers: the median of the receivers'
    ratios, or without any, the lower quartile of the others' (module docstring)."""
    received: dict[int, list[float]] = {}
    other: dict[int, list[float]] = {}
    for run in runs:
        for t in run.transfers:
            level = model.level_between(t.rank, t.peer)
            predicted = model.p2p_seconds(t.nbytes, level)
            if predicted > 0 and t.seconds > 0:
                (received if t.sent is False else other).setdefault(level, []).append(t.seconds / predicted)
    out = []
    for lv in sorted({*received, *other}):
        mine = received.get(lv)
        out.append((lv, statistics.median(mine) if mine else sorted(other[lv])[len(other[lv]) // 4]))
    return tuple(out)


def stage_load(costs: ModelCosts, run: RunObservation, index: int) -> tuple[StageLoad, int]:
    """A stage's profiled and measured compute per step and its link bytes (interference.py); and k."""
    st = run.stages[index]
    r = max(1, len(st.ranks))
    k = -(-run.micro_batches // r)
    syncs = get_schedule(run.schedule).syncs_per_step(k)
    a_in, g_out = costs.input_bytes(st.first)
    a_out, g_in = costs.output_bytes(st.last) if index < len(run.stages) - 1 else (0.0, 0.0)
    nbytes, ring = link_bytes(r, float(costs.param_bytes[st.first:st.last + 1].sum()),
                              (a_in + g_out + a_out + g_in) / 2, k, syncs)
    profiled = k * float(costs.forward_ms[st.first:st.last + 1].sum() + costs.backward_ms[st.first:st.last + 1].sum())
    return StageLoad(profiled, k * ((st.forward_ms or 0.0) + (st.backward_ms or 0.0)), nbytes, ring), k


def without_interference(costs: ModelCosts, run: RunObservation, lost_ms_per_byte: float) -> RunObservation:
    """``run`` with each stage's forward and backward less what its link bytes cost it (shared by their times)."""
    stages = []
    for k, st in enumerate(run.stages):
        if st.forward_ms is None or st.backward_ms is None or lost_ms_per_byte <= 0:
            stages.append(st)
            continue
        load, per_step = stage_load(costs, run, k)
        cut = lost_ms_per_byte * load.nbytes / per_step / (st.forward_ms + st.backward_ms)    # share per micro-batch
        stages.append(replace(st, forward_ms=st.forward_ms * max(1 - cut, 0.01),
                              backward_ms=st.backward_ms * max(1 - cut, 0.01)))
    return replace(run, stages=tuple(stages))


def stage_tied_ms(profile: Profile, run: RunObservation, model: CostModel) -> tuple[list[float], list[TiedEvidence]]:
    """Per stage of ``run``: the model's tied sums it takes part in (ms per step); and each group."""
    stages = [StageSpec(s.first, s.last, s.ranks) for s in run.stages]
    per_stage = [0.0] * len(stages)
    groups = []
    for g in priced_tied(profile, stages, model):
        for k in g.stages:
            per_stage[k] += g.predicted_ms
        groups.append(TiedEvidence(tuple(g.stages), g.predicted_ms))
    return per_stage, groups


def step_evidence(profile: Profile, costs: ModelCosts, model: CostModel, run: RunObservation,
                  optimizer: str = "sgd") -> tuple[list[StepStage], list[TiedEvidence]]:
    """The stages of ``run`` that measured their ``step`` phase, against the model (step.py)."""
    tied, groups = stage_tied_ms(profile, run, model)
    opt = costs.optimizer_ms(optimizer)
    kind = get_schedule(run.schedule)
    index: dict[int, int] = {}
    out: list[StepStage] = []
    for k, st in enumerate(run.stages):
        if st.step_ms is None:
            continue
        syncs = kind.syncs_per_step(-(-run.micro_batches // max(1, len(st.ranks))))
        index[k] = len(out)
        out.append(StepStage(float(opt[st.first:st.last + 1].sum()) * syncs, tied[k], st.step_ms))
    kept = [TiedEvidence(tuple(index[k] for k in g.stages), g.predicted_ms) for g in groups
            if all(k in index for k in g.stages)]
    return out, kept


def stage_layouts(runs: Sequence[RunObservation], phase: str) -> list[list[tuple[int, int, float]]]:
    """The runs' measured stages (first, last, ms of ``phase``), grouped by the runs' stage layout."""
    out: dict[tuple, list[tuple[int, int, float]]] = {}
    for r in runs:
        key = tuple((s.first, s.last) for s in r.stages)
        out.setdefault(key, []).extend((s.first, s.last, v) for s in r.stages if (v := getattr(s, phase)) is not None)
    return [v for v in out.values() if v]
