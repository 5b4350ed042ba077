"""Sync units and lanes (syncunits.py) and their place in the plan: decided by partition, written,
validated on load (one line per defect), and kept through a save and a load."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.syncunits import (
    SECOND_LANE_ALGORITHMS,
    LayerSync,
    assign_units,
    latency_bound_bytes,
    with_algorithm,
)
from hybridpipe.partitioner.plan import ALGORITHMS, Plan, load_plan, save_plan
from hybridpipe.partitioner.planner import Request, partition
from tests.partitioner.synth import make_profile, two_level

MODEL = CostModel(two_level(2, 4))
RANKS = (0, 2, 4, 6)                  # one per host: every all-reduce crosses the network


def layers(spec: list[tuple[int, str]]) -> list[LayerSync]:
    return [LayerSync(f"l{k}", (f"l{k}.weight",), b, a, MODEL.allreduce_seconds(a, b, RANKS) * 1e3)
            for k, (b, a) in enumerate(spec)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([64, 4_000, 40_000, 400_000, 40_000_000]), st.sampled_from(ALGORITHMS)),
                min_size=1, max_size=9), st.booleans(), st.booleans())
def test_units_are_runs_of_one_algorithm_within_its_latency_bound(spec, fuse, lanes):
    given_layers = layers(spec)
    out = assign_units(given_layers, RANKS, MODEL, fuse_small=fuse, two_lanes=lanes)
    assert [lv.algorithm for lv in out] == [lv.algorithm for lv in given_layers]      # the priced choice is kept
    assert [lv.predicted_ms for lv in out] == [lv.predicted_ms for lv in given_layers]
    units = [lv.unit for lv in out]
    assert units == sorted(units) and units[0] == 0 and all(b - a in (0, 1) for a, b in pairwise(units))
    for k in set(units):
        members = [lv for lv in out if lv.unit == k]
        assert len({(lv.algorithm, lv.lane) for lv in members}) == 1
        if len(members) > 1:
            assert fuse
            bound = latency_bound_bytes(lambda b, a=members[0].algorithm: MODEL.allreduce_seconds(a, b, RANKS))
            assert sum(lv.bytes for lv in members) <= bound
    assert all(lv.lane == 0 or (lanes and lv.algorithm in SECOND_LANE_ALGORITHMS) for lv in out)


def test_small_early_units_go_on_the_second_lane_if_their_algorithm_can_run_there():
    spec = [(4_000, "butterfly"), (8_000, "native"), (40_000_000, "ring"), (8_000_000, "ring")]
    out = assign_units(layers(spec), RANKS, MODEL, fuse_small=False)
    assert [lv.lane for lv in out] == [1, 0, 0, 0]                     # native stays on the main lane
    chosen = assign_units(layers(spec), RANKS, MODEL, fuse_small=False, lane_algorithms=SECOND_LANE_ALGORITHMS)
    assert [lv.lane for lv in chosen] == [1, 1, 0, 0] and chosen[1].algorithm in SECOND_LANE_ALGORITHMS
    assert chosen[1].predicted_ms == pytest.approx(MODEL.allreduce_seconds(chosen[1].algorithm, 8_000, RANKS) * 1e3)
    assert all(lv.lane == 0 for lv in assign_units(layers(spec), RANKS, MODEL, two_lanes=False))


def test_one_fixed_algorithm_fuses_the_small_layers():
    out = with_algorithm(layers([(64, "ring"), (128, "butterfly"), (40_000_000, "native")]), "ring", RANKS, MODEL)
    assert [lv.algorithm for lv in out] == ["ring"] * 3 and [lv.unit for lv in out] == [0, 0, 1]
    assert out[2].predicted_ms == pytest.approx(MODEL.allreduce_seconds("ring", 40_000_000, RANKS) * 1e3)


def _plan(tmp_path) -> tuple[Plan, dict]:
    prof = make_profile([(1, 2, 100, 400), (1, 2, 100, 800), (1, 2, 100, 64_000_000), (1, 2, 100, 4_000_000)])
    plan = partition(prof, two_level(2, 2), Request(workers=4, strategy="dp", micro_batches=4)).plan
    path = save_plan(plan, tmp_path / "plan.json")
    return plan, json.loads(path.read_text())


def test_partition_writes_units_and_lanes_and_they_round_trip(tmp_path):
    plan, data = _plan(tmp_path)
    (stage,) = plan.stages
    assert [lv.unit for lv in stage.layers] == [0, 0, 1, 2]               # the two tiny layers share one all-reduce
    assert [lv.lane for lv in stage.layers][:2] == [1, 1]                # and go on the second lane
    assert [[lv.layer for lv in u] for u in stage.sync_units()] == [["l1", "l2"], ["l3"], ["l4"]]
    assert {"unit", "lane"} <= set(data["stages"][0]["layers"][0])
    assert load_plan(tmp_path / "plan.json") == plan


def _edited(tmp_path, data: dict, *edits: dict) -> str:
    for k, edit in enumerate(edits):
        data["stages"][0]["layers"][k].update(edit)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        load_plan(path)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("edits,expected", [
    (({"algorithm": "telepathy"},), "layer 0 ('l1'): unknown all-reduce algorithm 'telepathy'; use one of ring"),
    (({"algorithm": "aggregator"},), "aggregator cannot run on sync lane 1"),
    (({"lane": 2},), "field \"lane\" must be one of 0, 1"),
    (({}, {"algorithm": "native", "lane": 0}), "layers 'l1' and 'l2' share sync unit 0 but not their algorithm and "
                                               "lane (butterfly/1 vs native/0)"),
    (({}, {"unit": 1}, {"unit": 0}), "sync unit 0 holds 'l1' and 'l3', which are not adjacent"),
    (({"params": ["l2.weight"]},), "parameter 'l2.weight' is synced by two layers, 'l1' and 'l2'"),
])
def test_hand_edits_the_runtime_cannot_run_are_refused_in_one_line(tmp_path, edits, expected):
    plan, data = _plan(tmp_path)
    assert plan.stages[0].layers[0].algorithm == "butterfly"
    assert expected in _edited(tmp_path, data, *edits)


def test_a_plan_without_units_or_lanes_reads_each_layer_as_its_own_unit(tmp_path):
    plan, data = _plan(tmp_path)
    for lv in data["stages"][0]["layers"]:
        del lv["unit"], lv["lane"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_plan(path).stages[0]
    assert [lv.unit for lv in old.layers] == [None] * 4 and [lv.lane for lv in old.layers] == [0] * 4
    assert len(old.sync_units()) == 4
    assert dataclasses.replace(old, layers=plan.stages[0].layers) == plan.stages[0]
