"""Sharded replicas in the search: the DP with --shard against brute force over every level per stage."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search import dp
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.sharding import NONE, VARIANTS, sharded_variants
from hybridpipe.partitioner.search.strategies import baseline_stages
from tests.partitioner.synth import all_layouts, flat_cluster, make_profile, two_level

LAYER = st.tuples(st.sampled_from([0.0, 0.3, 2.0, 9.0]), st.sampled_from([0.0, 0.5, 4.0, 20.0]),
                  st.sampled_from([0, 2_000, 300_000, 4_000_000]), st.sampled_from([0, 8_000, 900_000, 60_000_000]))
SHARDS = ["auto", "auto", "optimizer", "gradients", "parameters"]
OPTIONS = st.tuples(st.sampled_from(["gpipe", "1f1b", "zb-h1", "pipedream"]), st.integers(1, 6),
                    st.sampled_from(["sgd", "adamw"]), st.sampled_from([math.inf, 1e9, 4e8, 1.5e8, 6e7]),
                    st.sampled_from(["none", "auto"]), st.sampled_from(SHARDS)).map(
    lambda t: Options(get_schedule(t[0]), t[1], t[2], t[3], recompute=t[4],
                      shard="auto" if t[0] == "pipedream" else t[5]))     # a level needs a flushed schedule
CLUSTERS = st.one_of(st.builds(flat_cluster, st.integers(1, 4), st.sampled_from([0.1, 1.0, 10.0]),
                               st.sampled_from([0.0, 50.0])),
                     st.builds(two_level, st.integers(1, 2), st.integers(1, 2), st.just(40.0),
                               st.sampled_from([0.1, 1.0])))


def allowed(opts: Options, replicas: int):
    """Every level a stage may take, listed here from the rule (not from Options.variants)."""
    if replicas == 1 or opts.schedule.asynchronous:
        return (NONE,)
    return VARIANTS if opts.shard == "auto" else sharded_variants(opts.shard)


def brute_force(costs, model, workers, opts):
    """(best objective, least sum of terms reaching it) over every layout x every level of every stage."""
    scored = []
    for stages in all_layouts(costs.n, model, workers, dp.copy_counts(model, workers)):
        for combo in itertools.product(*(allowed(opts, len(s.ranks)) for s in stages)):
            ev = evaluate(costs, model, stages, opts, variants=combo)
            scored.append((ev.objective_ms, sum(e.term_ms for e in ev.stages)))
    best = min(v for v, _ in scored)
    if math.isinf(best):
        return best, best
    return best, min(t for v, t in scored if v <= best * (1 + 1e-9) + 1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=4), CLUSTERS, OPTIONS)
def test_dp_with_shard_equals_brute_force_over_levels(layers, cluster, opts):
    """Up to 6 nodes on up to 4 workers, every flushed schedule and pipedream (no sharding there), memory
    tight enough that levels decide what fits: the DP's optimum and tie-broken plan = enumerating every
    layout and every level per stage (25 cases; 500: make test-slow)."""
    check_against_brute_force(layers, cluster, opts)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=4), CLUSTERS, OPTIONS)
def test_dp_with_shard_equals_brute_force_over_levels_many(layers, cluster, opts):
    check_against_brute_force(layers, cluster, opts)


def check_against_brute_force(layers, cluster, opts):
    check_costs_against_brute_force(model_costs(make_profile(layers, [])), cluster, opts)


def check_costs_against_brute_force(costs, cluster, opts):
    """The DP on ``costs`` (optimizer steps timed) = brute force, its plan's levels as ``opts`` allow."""
    costs = dataclasses.replace(costs, step_ms=(("sgd", 5.0), ("adamw", 10.0)))
    model = CostModel(cluster)
    workers = cluster.total_workers
    bound = evaluate(costs, model, baseline_stages("dp", costs, workers), opts).objective_ms
    sol = dp.solve(costs, model, workers, opts, bound)
    best, least_total = brute_force(costs, model, workers, opts)
    if math.isinf(best):
        assert not sol.stages
        return
    ev = evaluate(costs, model, sol.stages, opts)
    assert sol.objective_ms == pytest.approx(best, rel=1e-9)
    assert ev.objective_ms == pytest.approx(best, rel=1e-9)
    assert sum(e.term_ms for e in ev.stages) == pytest.approx(least_total, rel=1e-9)
    for spec, e in zip(sol.stages, ev.stages, strict=True):
        assert e.memory_bytes <= opts.memory_bytes
        if len(spec.ranks) == 1 or opts.schedule.asynchronous:
            assert e.shard == "none"          # a level on one replica (or under pipedream) is never chosen
        elif opts.shard != "auto":
            assert e.shard == opts.shard
        if e.shard in ("gradients", "parameters"):     # per-micro-batch reduce-scatters: launch refuses others
            assert opts.micro_batches % len(spec.ranks) == 0


def test_shard_none_is_todays_objective_bit_for_bit():
    """--shard none evaluates exactly as before (the variants path never runs)."""
    costs = model_costs(make_profile([(2.0, 4.0, 300_000, 4_000_000)] * 4, []))
    model = CostModel(flat_cluster(4, 1.0, 50.0))
    stages = baseline_stages("dp", costs, 4)
    a = evaluate(costs, model, stages, Options(get_schedule("1f1b"), 8, "adamw"))
    b = evaluate(costs, model, stages, Options(get_schedule("1f1b"), 8, "adamw", shard="none"))
    assert a == b and a.stages[0].shard == "none"


def test_gradients_and_parameters_need_a_multiple_of_the_replicas_in_micro_batches():
    """ZeRO-2/3 reduce-scatter once a micro-batch, so launch refuses them on r replicas unless r divides M
    (pipeline/plancheck.check_shards): the search never chooses them there. 4 nodes on 2 workers, 3
    micro-batches: forced, the level does not fit; auto leaves it out; an explicit level takes another layout."""
    costs = model_costs(make_profile([(2.0, 4.0, 300_000, 4_000_000)] * 4, []))
    model = CostModel(flat_cluster(2, 1.0, 50.0))
    stages = baseline_stages("dp", costs, 2)
    for level in ("gradients", "parameters"):
        opts = Options(get_schedule("1f1b"), 3, "adamw", shard=level)
        (variant,) = (v for v in sharded_variants(level) if v.reshard)
        assert not evaluate(costs, model, stages, opts, variants=[variant]).fits
        assert evaluate(costs, model, stages, dataclasses.replace(opts, micro_batches=4), variants=[variant]).fits
        sol = dp.solve(costs, model, 2, opts, math.inf)
        assert sol.stages and all(len(s.ranks) == 1 for s in sol.stages)     # a pipeline of 2 instead
    auto = Options(get_schedule("1f1b"), 3, "adamw", shard="auto")
    assert {v.level for v in auto.variants(2)} == {"none", "optimizer"}
    assert {v.level for v in dataclasses.replace(auto, micro_batches=4).variants(2)} == {
        "none", "optimizer", "gradients", "parameters"}
    assert {v.level for v in dataclasses.replace(auto, micro_batches=4, zero3=False).variants(2)} == {
        "none", "optimizer", "gradients"}


def test_level_for_pipedream_or_without_paired_algorithms_is_one_line():
    with pytest.raises(UserError, match="flushed schedule"):
        Options(get_schedule("pipedream"), 4, shard="optimizer")
    with pytest.raises(UserError, match="--algorithms"):
        Options(get_schedule("1f1b"), 4, algorithms=("aggregator",), shard="gradients")
    with pytest.raises(UserError, match="unknown --shard"):
        Options(get_schedule("1f1b"), 4, shard="zero3")
    assert Options(get_schedule("pipedream"), 4, shard="auto").variants(4) == (NONE,)
