"""Shard levels: the memory formulas, the collectives' cost, and what --shard does to a plan."""

from __future__ import annotations

import json
import math

import pytest

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.sharded import all_gather_seconds, fastest_pair, reduce_scatter_seconds
from hybridpipe.partitioner.plan import load_plan
from hybridpipe.partitioner.plan_parts import SHARD_LEVELS
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.sharding import (
    NONE,
    Variant,
    largest_units,
    midstep_ms,
    static_bytes,
)
from hybridpipe.partitioner.search.stagememory import memory_bytes
from hybridpipe.pipeline.simulator import simulate
from hybridpipe.profiles.format import save_profile
from tests.partitioner.synth import flat_cluster, make_profile

W = 1_000_000.0       # a stage's weight bytes


@pytest.mark.parametrize(("variant", "r", "states", "expected"), [
    (NONE, 4, 2, 4 * W),                                   # W + G + O, adam: O = 2 W
    (Variant("optimizer"), 4, 2, 2 * W + 2 * W / 4),      # W + G + O / r
    (Variant("optimizer"), 2, 1, 2 * W + W / 2),          # sgd momentum: O = W
    (Variant("gradients"), 4, 2, W + W / 4 + 2 * W / 4 + 300.0),         # + the largest unit's gradient
    (Variant("parameters", True), 4, 2, (W + W + 2 * W) / 4 + 500.0),     # + the two largest units' weights
    (Variant("parameters", False), 4, 2, (W + W + 2 * W) / 4 + W + 300.0),  # + the whole stage, kept, and
    #                                                                          the unit being reduce-scattered
])
def test_static_bytes_is_the_contract(variant, r, states, expected):
    """none = W+G+O; optimizer = W+G+O/R; gradients = W+G/R+O/R+largest unit's gradient; parameters =
    W/R+G/R+O/R + two largest units (reshard after forward) or W + the largest unit's gradient (kept)."""
    assert static_bytes(variant, W, r, states, 300.0, 500.0) == pytest.approx(expected)


def test_largest_units_tables():
    top1, top2 = largest_units([5.0, 0.0, 9.0, 7.0])
    assert top1[0, 0] == 5 and top2[0, 0] == 5
    assert top1[0, 3] == 9 and top2[0, 3] == 16
    assert top1[1, 1] == 0 and top2[1, 2] == 9 and top2[2, 3] == 16


def test_memory_of_a_sharded_stage_in_the_objective():
    """stagememory.memory_bytes with adamw on 4 replicas: ZeRO-1 saves 1.5 W, ZeRO-3 (resharding) about 3 W."""
    costs = model_costs(make_profile([(1.0, 2.0, 1000, 4_000_000)] * 3, []))
    opts = Options(get_schedule("1f1b"), 8, "adamw")
    w = costs.weight_bytes(0, 4)
    full = memory_bytes(costs, 0, 4, 2, opts)
    assert full - memory_bytes(costs, 0, 4, 2, opts, variant=Variant("optimizer"), replicas=4) == pytest.approx(1.5 * w)
    z3 = memory_bytes(costs, 0, 4, 2, opts, variant=Variant("parameters"), replicas=4)
    assert full - z3 == pytest.approx(3 * w - 2 * 4_000_000)


def test_midstep_collectives():
    half, f, b = 10.0, 3.0, 6.0
    assert midstep_ms(Variant("optimizer"), 4, half, f, b) == 0
    assert midstep_ms(Variant("gradients"), 1, half, f, b) == 0          # one micro-batch: all on the lane
    assert midstep_ms(Variant("gradients"), 4, half, f, b) == 3 * (10 - 6)
    assert midstep_ms(Variant("parameters", False), 4, half, f, b) == 3 * (10 - 6)
    assert midstep_ms(Variant("parameters", True), 4, half, f, b) == 3 * (20 - 6) + (10 - 6) + 3 * (10 - 3)


def test_reduce_scatter_and_all_gather_are_halves_of_a_ring_all_reduce():
    model = CostModel(flat_cluster(4, 1.0, 50.0))
    ranks, nbytes = [0, 1, 2, 3], 8e6
    ring = model.allreduce_seconds("ring", nbytes, ranks)
    assert fastest_pair(nbytes, ranks, model, ("ring",)) == ("ring", pytest.approx(ring))
    assert reduce_scatter_seconds(nbytes, ranks, model, ("ring",)) == pytest.approx(ring / 2)
    assert all_gather_seconds(nbytes, ranks, model, ("ring",)) == pytest.approx(ring / 2)
    # recursive doubling wins small all-reduces but has no halves: sharding pays Rabenseifner's latencies
    small = 64.0
    assert fastest_pair(small, ranks, model, ("butterfly",))[1] >= model.allreduce_seconds("butterfly", small, ranks)
    with pytest.raises(ValueError):
        fastest_pair(small, ranks, model, ("aggregator",))


BIG = [(5.0, 10.0, 1_000_000, 100_000_000)] * 4          # 4 layers of 100 MB weights, little compute
FAST = flat_cluster(4, 100.0, 5.0)


def plan_for(shard: str, memory_gb: float = 0.8, micro: int = 8):
    req = Request(optimizer="adamw", memory_gb=memory_gb, micro_batches=micro, shard=shard)
    return partition(make_profile(BIG, []), FAST, req).plan


def test_auto_shards_where_replicated_needs_more_stages():
    """Under --memory-gb replicated stages need one layer per worker (4 stages); --shard auto fits the same
    model in fewer stages with a sharded replicated stage, predicted no slower."""
    none, auto = plan_for("none"), plan_for("auto")
    assert all(s.shard == "none" for s in none.stages) and len(none.stages) == 4
    assert len(auto.stages) < len(none.stages)
    assert any(s.shard != "none" for s in auto.stages)
    assert auto.predicted_step_ms <= none.predicted_step_ms
    assert all(s.memory_bytes <= 0.8e9 for s in auto.stages)


def test_a_level_is_never_chosen_for_one_replica():
    for shard in ("optimizer", "gradients", "parameters", "auto"):
        for s in plan_for(shard).stages:
            assert s.replicas > 1 or s.shard == "none"


def test_auto_chooses_among_the_levels_the_runtime_runs():
    """launch runs every level (ZeRO-3 too): auto plans among them; --shard parameters by name plans
    ZeRO-3."""
    levels = set()
    for memory_gb in (0.3, 0.5, 0.8, 4.0):
        try:
            auto = plan_for("auto", memory_gb=memory_gb)
        except UserError:
            continue
        assert all(s.shard in SHARD_LEVELS for s in auto.stages)
        levels |= {s.shard for s in auto.stages}
    assert "parameters" in SHARD_LEVELS and levels - {"none"}
    out = partition(make_profile(BIG, []), FAST, Request(optimizer="adamw", memory_gb=0.8, micro_batches=8,
                                                        shard="parameters"))
    assert any(s.shard == "parameters" for s in out.plan.stages)


def test_parameters_lets_data_parallelism_fit():
    """--shard parameters: the plan that needs the least memory per worker is data parallel over 4 with ZeRO-3;
    without sharding data parallelism does not fit."""
    costs = model_costs(make_profile(BIG, []))
    model = CostModel(FAST)
    dp = [StageSpec(0, costs.n - 1, (0, 1, 2, 3))]
    opts = Options(get_schedule("1f1b"), 8, "adamw", 0.8e9)
    assert not evaluate(costs, model, dp, opts).fits
    ev = evaluate(costs, model, dp, Options(get_schedule("1f1b"), 8, "adamw", 0.8e9, shard="parameters"))
    assert ev.fits and ev.stages[0].shard == "parameters" and math.isfinite(ev.objective_ms)


def test_simulator_draws_reduce_scatter_and_all_gather():
    plan = plan_for("auto")
    kinds = {iv.kind for iv in simulate(plan).intervals}
    assert {"reduce_scatter", "all_gather"} <= kinds and "allreduce" not in kinds
    assert "allreduce" in {iv.kind for iv in simulate(plan_for("none", memory_gb=16)).intervals}


def test_partition_cli_shard_auto_records_levels_and_compares(tmp_path, capsys):
    prof = save_profile(make_profile(BIG, []), tmp_path / "big.json")
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(FAST.to_dict()))
    out = tmp_path / "plan.json"
    assert main(["partition", str(prof), "--cluster", str(cluster), "--optimizer", "adamw", "--memory-gb", "0.8",
                 "--micro-batches", "8", "--shard", "auto", "--compare", "-q", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert any(s.shard != "none" for s in plan.stages)
    assert "ZeRO-" in text and "best replicated" in text and "best sharded" in text
    assert "optimal --shard none" in text
    assert main(["partition", str(prof), "--cluster", str(cluster), "--shard", "zero9"]) == 2
