"""The runtime's view of a plan's sync, without processes: the plan's layers checked against the
stage, mapped onto HybridDataParallel's units exactly, overrides and their line, the summary."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from hybridpipe.comm.hybrid_dp import model_layers, units_from_choices
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.syncunits import LayerSync
from hybridpipe.partitioner.plan import Stage
from hybridpipe.pipeline.plancheck import check_sync_layers
from hybridpipe.runtime.summary import RankReport, sync_line, sync_summary
from hybridpipe.runtime.sync import describe_override, override_layers, stage_layers, unit_choices
from tests.partitioner.synth import flat_cluster

MODEL = CostModel(flat_cluster(4))
RANKS = (0, 1, 2, 3)


def stage_module() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 256), nn.Linear(256, 256))


def planned() -> tuple[LayerSync, ...]:
    m = stage_module()
    size = {n: p.numel() * 4 for n, p in m.named_parameters()}
    spec = [("_0", "0", "butterfly", 0, 1), ("_2", "2", "butterfly", 0, 1), ("_3", "3", "native", None, 0)]
    return tuple(LayerSync(name, (f"{mod}.weight", f"{mod}.bias"), size[f"{mod}.weight"] + size[f"{mod}.bias"], a,
                           unit=unit, lane=lane) for name, mod, a, unit, lane in spec)


def stage(layers=None) -> Stage:
    return Stage(1, 5, 9, 4, RANKS, layers=planned() if layers is None else layers)


def test_the_plans_units_are_the_units_that_run():
    module = stage_module()
    layers = stage_layers(stage(), module, MODEL)
    units = units_from_choices(model_layers(module), unit_choices(layers))
    assert [(u.name, u.algorithm, u.lane) for u in units] == [("_0+_2", "butterfly", 1), ("_3", "native", 0)]
    assert [set(u.param_names) for u in units] == [{"0.weight", "0.bias", "2.weight", "2.bias"},
                                                   {"3.weight", "3.bias"}]


def test_layers_that_do_not_cover_the_stage_are_refused():
    lv = planned()
    with pytest.raises(UserError, match="the plan's layers do not sync parameter '3.bias'"):
        check_sync_layers(stage(lv[:2] + (dataclasses.replace(lv[2], params=("3.weight",)),)), stage_module())
    with pytest.raises(UserError, match="the plan syncs parameter 'x.weight', which the stage does not have"):
        check_sync_layers(stage(lv + (LayerSync("x", ("x.weight",), 4, "ring"),)), stage_module())


def test_without_layers_the_stage_gets_what_partition_would_write():
    derived = stage_layers(stage(()), stage_module(), MODEL)
    assert [lv.layer for lv in derived] == ["0", "2", "3"]
    assert all(lv.unit is not None and lv.algorithm for lv in derived)


def test_overrides_and_their_line():
    lv = planned()
    ring = override_layers(lv, "ring", RANKS, MODEL)
    assert [x.algorithm for x in ring] == ["ring"] * 3
    line = describe_override(1, "--allreduce ring", lv, ring)
    assert line.startswith("launch.py: stage 1: --allreduce ring overrides the plan: 3 of 3 layers change algorithm: "
                           "_0 butterfly->ring, _2 butterfly->ring, _3 native->ring")
    same = override_layers(lv, "hybrid", RANKS, MODEL)
    assert describe_override(1, "--allreduce hybrid", same, same) == \
        "launch.py: stage 1: --allreduce hybrid changes nothing against the plan (3 layers)"


def test_summary_records_what_ran_next_to_the_plan():
    ran = [{"layer": "_0", "algorithm": "butterfly", "planned": "butterfly"},
           {"layer": "_3", "algorithm": "native", "planned": "native"}]
    reports = [RankReport(0, 0, 0), RankReport(1, 1, 0, sync=ran), RankReport(2, 1, 1, sync=ran)]
    sync, as_planned = sync_summary(reports)
    assert sync == {"1": ran} and as_planned is True
    assert sync_line(sync, as_planned) == \
        "  all-reduce: as the plan says (2 layers in 1 replicated stage(s): 1 butterfly, 1 native)"
    other = [dict(ran[0], algorithm="ring"), ran[1]]
    sync, as_planned = sync_summary([RankReport(1, 1, 0, sync=other)])
    assert as_planned is False
    assert sync_line(sync, as_planned) == "  all-reduce: NOT as the plan says: stage 1 _0 ring (plan: butterfly)"
    assert sync_summary([RankReport(0, 0, 0)]) == ({}, None)
