"""The optimal partition against brute force, and the shapes it must find on known cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search import dp
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.strategies import baseline_stages
from tests.partitioner.synth import brute_force, flat_cluster, make_profile, two_level

LAYER = st.tuples(st.sampled_from([0.0, 0.3, 2.0, 9.0]), st.sampled_from([0.0, 0.5, 4.0, 20.0]),
                  st.sampled_from([0, 2_000, 300_000, 4_000_000]), st.sampled_from([0, 8_000, 900_000, 60_000_000]))
OPTIONS = st.builds(Options, schedule=st.sampled_from(["gpipe", "1f1b", "pipedream", "zb-h1"]).map(get_schedule),
                    micro_batches=st.integers(1, 8), optimizer=st.sampled_from(["sgd", "adam"]),
                    memory_bytes=st.sampled_from([math.inf, 1e9, 4e8, 1.5e8]),
                    recompute=st.sampled_from(["none", "all", "auto"]))


def clusters(max_workers: int):
    flat = st.builds(flat_cluster, st.integers(1, max_workers), st.sampled_from([0.1, 1.0, 10.0]),
                     st.sampled_from([0.0, 50.0]))
    hier = st.builds(two_level, st.integers(1, 3), st.integers(1, 3), st.just(40.0), st.sampled_from([0.1, 1.0]))
    return st.one_of(flat, hier.filter(lambda c: c.total_workers <= max_workers))


# (ms of one sgd step over all parameters, compute lost per byte of communication)
OVERHEADS = st.tuples(st.sampled_from([0.0, 5.0, 40.0]), st.sampled_from([0.0, 1e-9, 2e-8]))


# the stage compute terms (cost/computeterms.py): rho by replica count (below 1 too), accumulation per byte
TERMS = st.tuples(st.sampled_from([(), ((2, 1.3),), ((2, 0.8), (4, 1.25)), ((3, 1.1), (6, 0.9))]),
                  st.sampled_from([0.0, 1e-10, 5e-9]))


def check_against_brute_force(layers, skip, cluster, opts, overheads=(0.0, 0.0), blockers=(), transients=(),
                              half: float | None = None, terms=((), 0.0)):
    skips = [(0, len(layers))] if skip and len(layers) > 1 else []
    step_ms, interference = overheads
    costs = dataclasses.replace(model_costs(make_profile(layers, skips, blockers=blockers)),
                                step_ms=(("sgd", step_ms), ("adam", 2 * step_ms)))
    if transients:      # each node's transient bytes (cycled over the nodes)
        costs = dataclasses.replace(costs, transient=np.array([transients[k % len(transients)]
                                                               for k in range(costs.n)], dtype=float))
    if half is not None:    # what stays between a split backward's halves: this share of the stash, a third recorded
        stash = costs.stash_table()[0]
        costs = dataclasses.replace(costs, half=stash * half, recorded=stash * half / 3)
    model = CostModel(cluster)
    model.interference_s_per_byte = interference
    model.replica_compute, model.accumulate_s_per_byte = terms
    workers = cluster.total_workers
    bound = evaluate(costs, model, baseline_stages("dp", costs, workers), opts).objective_ms
    sol = dp.solve(costs, model, workers, opts, bound)
    best, least_total = brute_force(costs, model, workers, opts, dp.copy_counts(model, workers))
    if math.isinf(best):
        assert not sol.stages and math.isinf(sol.objective_ms)
        return
    ev = evaluate(costs, model, sol.stages, opts)
    assert sol.objective_ms == pytest.approx(best, rel=1e-9)
    assert ev.objective_ms == pytest.approx(best, rel=1e-9)
    assert sum(e.term_ms for e in ev.stages) == pytest.approx(least_total, rel=1e-9)
    assert sorted(r for s in sol.stages for r in s.ranks) == list(range(workers))
    assert all(e.memory_bytes <= opts.memory_bytes for e in ev.stages)
    assert all(costs.blocked_cut(s.last) is None for s in sol.stages)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, OVERHEADS)
def test_dp_equals_brute_force(layers, skip, cluster, opts, overheads):
    """Up to 7 nodes (input, 5 layers, output), 6 workers, 1 or 2 levels, every schedule, with and
    without optimizer steps and compute lost to communication (30 cases; 2000: make test-slow)."""
    check_against_brute_force(layers, skip, cluster, opts, overheads)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, st.sets(st.integers(0, 5)))
def test_dp_equals_brute_force_with_blocked_cuts(layers, skip, cluster, opts, blockers):
    """Some cuts split a value that cannot cross a stage boundary: no plan may cut there (brute force
    enumerates every layout and ``evaluate`` rejects those that do). 20 cases; 1000: make test-slow."""
    check_against_brute_force(layers, skip, cluster, opts, blockers=sorted(blockers))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS,
       st.lists(st.sampled_from([0.0, 1e6, 5e7, 2e8]), min_size=1, max_size=7))
@example([(0.0, 0.0, 0, 0)], False, flat_cluster(1, 0.1, 0.0), Options(get_schedule("gpipe"), 1, "sgd", 1.5e8), [2e8])
def test_dp_equals_brute_force_with_transient_bytes(layers, skip, cluster, opts, transients):
    """Nodes whose kernels allocate for a moment (stagememory.transient_bytes): the DP's vectorised memory
    bound is the objective's (20 cases)."""
    check_against_brute_force(layers, skip, cluster, opts, transients=transients)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6),
       OPTIONS.map(lambda o: dataclasses.replace(o, schedule=get_schedule("zb-h1"))),
       st.sampled_from([0.0, 0.3, 1.0, 1.6]))
@example([(1.0, 2.0, 40_000_000, 20_000_000)] * 2, False, flat_cluster(2),
         Options(get_schedule("zb-h1"), 4, "sgd", 2e8), 0.3)   # only 2 stages fit, with stage 1's half at 0.3
def test_dp_equals_brute_force_with_weight_halves(layers, skip, cluster, opts, half):
    """zb-h1 stages holding part of their stash between B and W (ModelCosts.half), or more (1.6: the
    recorded gradients of a big vocabulary's logits): the DP's vectorised memory bound is the
    objective's (10 cases)."""
    check_against_brute_force(layers, skip, cluster, opts, half=half)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, OVERHEADS, TERMS)
@example([(2.0, 4.0, 300_000, 4_000_000)] * 3, False, flat_cluster(4, 0.1), Options(get_schedule("1f1b"), 8, "sgd",
                                                                                     math.inf),
         (0.0, 0.0), (((2, 0.8), (4, 1.25)), 5e-9))
def test_dp_equals_brute_force_with_compute_terms(layers, skip, cluster, opts, overheads, terms):
    """The replicas' compute stretch (some below 1: the relaxation's bound must still hold) and gradient
    accumulation (cost/computeterms.py): the DP's vectorised terms are the objective's (30 cases; 400: slow)."""
    check_against_brute_force(layers, skip, cluster, opts, overheads, terms=terms)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, OVERHEADS, TERMS)
def test_dp_equals_brute_force_with_compute_terms_many(layers, skip, cluster, opts, overheads, terms):
    check_against_brute_force(layers, skip, cluster, opts, overheads, terms=terms)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "zb-h1"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, OVERHEADS)
def test_dp_equals_brute_force_many(schedule, layers, skip, cluster, opts, overheads):
    """2000 cases as 500 per schedule (was one test of 2000 over the four: the same cases, but under load
    one test could pass pytest's 300 s limit)."""
    check_against_brute_force(layers, skip, cluster, dataclasses.replace(opts, schedule=get_schedule(schedule)),
                              overheads)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LAYER, min_size=1, max_size=5), st.booleans(), clusters(6), OPTIONS, st.sets(st.integers(0, 5)))
def test_dp_equals_brute_force_with_blocked_cuts_many(layers, skip, cluster, opts, blockers):
    check_against_brute_force(layers, skip, cluster, opts, blockers=sorted(blockers))


# AlexNet's shape: convolutions with most of the compute and little of the weights, then fully
# connected layers with most of the weights (seed 000, table 1) and little compute.
CONV_FC = [(8.0, 16.0, 3_000_000, 140_000), (6.0, 12.0, 2_000_000, 2_400_000), (5.0, 10.0, 1_000_000, 3_500_000),
           (4.0, 8.0, 400_000, 5_300_000), (0.6, 1.2, 16_000, 150_000_000), (0.3, 0.6, 16_000, 67_000_000),
           (0.1, 0.2, 4_000, 16_000_000)]


def test_slow_network_replicates_convolutions_and_not_the_fc_layers():
    costs = model_costs(make_profile(CONV_FC, batch_size=64))
    cluster = two_level(1, 4, outer_gbps=1.0)
    opts = Options(get_schedule("1f1b"), 8, "sgd", 16e9)
    sol = dp.solve(costs, CostModel(cluster), 4, opts)
    fc = next(s for s in sol.stages if s.first <= 5 <= s.last)          # node 5: the 150 MB layer
    assert len(sol.stages[0].ranks) >= 2                                 # the first convolutions: replicated
    assert len(fc.ranks) == 1 and fc.last == 8                           # the big FC layers: one worker
    data_parallel = evaluate(costs, CostModel(cluster), baseline_stages("dp", costs, 4), opts).objective_ms
    assert sol.objective_ms < data_parallel / 2


def test_fast_network_and_small_weights_is_pure_data_parallel():
    layers = [(5.0, 10.0, 4_000_000, 40_000)] * 5
    costs = model_costs(make_profile(layers, batch_size=64))
    sol = dp.solve(costs, CostModel(flat_cluster(4, gbps=100.0)), 4, Options(get_schedule("1f1b"), 8, "sgd"))
    assert len(sol.stages) == 1 and sorted(sol.stages[0].ranks) == [0, 1, 2, 3]


def test_memory_bound_is_respected_and_changes_the_plan():
    costs = model_costs(make_profile(CONV_FC, batch_size=64))
    model = CostModel(two_level(1, 4, outer_gbps=10.0))
    free = dp.solve(costs, model, 4, Options(get_schedule("gpipe"), 8, "adam"))
    gpipe = Options(get_schedule("gpipe"), 8, "adam")
    need = max(e.memory_bytes for e in evaluate(costs, model, free.stages, gpipe).stages)
    tight = Options(get_schedule("gpipe"), 8, "adam", need * 0.8)
    sol = dp.solve(costs, model, 4, tight)
    assert sol.stages and sol.stages != free.stages
    assert all(e.memory_bytes <= need * 0.8 for e in evaluate(costs, model, sol.stages, tight).stages)
    assert sol.objective_ms >= free.objective_ms
    impossible = dp.solve(costs, model, 4, Options(get_schedule("gpipe"), 8, "adam", 1e6))
    assert impossible.stages == () and math.isinf(impossible.objective_ms)


def test_copies_keep_a_pipeline_inside_each_host():
    """Two big, slow layers that do not fit on one worker together, with huge activations between them:
    a two-stage pipeline inside each host, replicated across hosts (copies), keeps the activations
    on the fast links; only the weights' sync crosses the slow network."""
    big = (500.0, 1000.0, 400_000_000, 300_000_000)
    costs = model_costs(make_profile([big, big, (1.0, 2.0, 1_000, 1_000)], batch_size=64, input_bytes=1000))
    cluster = two_level(2, 2, inner_gbps=400.0, outer_gbps=1.0)
    opts = Options(get_schedule("1f1b"), 8, "sgd", 2e9)
    model = CostModel(cluster)
    sol = dp.solve(costs, model, 4, opts)
    assert sol.copies == 2 and len(sol.stages) == 2
    assert [s.ranks for s in sol.stages] == [(0, 2), (1, 3)]           # one replica per host, replica-major
    contiguous = [StageSpec(0, 1, (0, 1)), StageSpec(2, 4, (2, 3))]        # a stage per host instead
    assert evaluate(costs, model, contiguous, opts).objective_ms > 2 * sol.objective_ms
    assert not evaluate(costs, model, baseline_stages("dp", costs, 4), opts).fits
