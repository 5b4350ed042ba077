"""The scalable optimal DP against the exhaustive one it replaces (``reference_dp.py``): the same plans.

Equal means the same stages (nodes and ranks), copies and objective, so the same predicted step:
the new solver computes every stage term with the same floating-point operations and breaks ties
the same way. Also checked here: its parts against their own references (the closed-form pricing
against ``CostModel.lines``, the exposure row against ``exposure_table``, the sync bound).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search import dp
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.objective import evaluate, predict_step_ms
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.stageterms import StageTerms
from hybridpipe.partitioner.search.strategies import baseline_stages
from tests.partitioner import reference_dp
from tests.partitioner.synth import make_profile

LAYER = st.tuples(st.sampled_from([0.0, 0.3, 2.0, 9.0]), st.sampled_from([0.0, 0.5, 4.0, 20.0]),
                  st.sampled_from([0, 2_000, 300_000, 4_000_000]), st.sampled_from([0, 8_000, 900_000, 60_000_000]))
BANDWIDTH = st.sampled_from([0.5, 1.0, 10.0, 100.0])


@st.composite
def clusters(draw, max_workers: int = 64) -> Cluster:
    """1 to 3 levels, 2 to ``max_workers`` workers in all."""
    fanouts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3).filter(
        lambda f: 2 <= math.prod(f) <= max_workers))
    levels = tuple(Level(f"l{k}", w, draw(BANDWIDTH), draw(st.sampled_from([0.0, 5.0, 50.0])))
                   for k, w in enumerate(fanouts))
    return Cluster(levels, 16.0)


def options(workers: int):
    return st.builds(Options, schedule=st.sampled_from(["gpipe", "1f1b", "pipedream", "zb-h1"]).map(get_schedule),
                     micro_batches=st.sampled_from(sorted({1, 2, 4, 8, workers, 2 * workers, 3 * workers})),
                     optimizer=st.sampled_from(["sgd", "adam"]),
                     memory_bytes=st.sampled_from([math.inf, math.inf, 1e9, 4e8, 1.5e8]),
                     recompute=st.sampled_from(["none", "none", "all", "auto"]))


def same_plan(costs, cluster: Cluster, opts: Options, overheads=(0.0, 0.0)) -> None:
    """The new solver returns exactly the exhaustive solver's plan."""
    step_ms, interference = overheads
    costs = dataclasses.replace(costs, step_ms=(("sgd", step_ms), ("adam", 2 * step_ms)))
    models = [CostModel(cluster) for _ in range(2)]
    for m in models:
        m.interference_s_per_byte = interference
    workers = cluster.total_workers
    bound = evaluate(costs, models[0], baseline_stages("dp", costs, workers), opts).objective_ms
    want = reference_dp.solve(costs, models[0], workers, opts, bound)
    got = dp.solve(costs, models[1], workers, opts, bound)
    assert (got.stages, got.copies) == (want.stages, want.copies)
    assert got.objective_ms == want.objective_ms or (math.isinf(got.objective_ms) and math.isinf(want.objective_ms))
    if got.stages:
        ev = evaluate(costs, models[1], got.stages, opts)
        assert predict_step_ms(ev, opts) == predict_step_ms(evaluate(costs, models[0], want.stages, opts), opts)
        assert got.complete and got.lower_bound_ms == got.objective_ms


def random_case(data) -> None:
    cluster = data.draw(clusters())
    workers = cluster.total_workers
    layers = data.draw(st.lists(LAYER, min_size=1, max_size=6 if workers <= 16 else 3))
    skip = data.draw(st.booleans()) and len(layers) > 1
    costs = model_costs(make_profile(layers, [(0, len(layers))] if skip else []))
    opts = data.draw(options(workers))
    overheads = data.draw(st.tuples(st.sampled_from([0.0, 5.0, 40.0]), st.sampled_from([0.0, 1e-9, 2e-8])))
    same_plan(costs, cluster, opts, overheads)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_scalable_dp_equals_the_exhaustive_one(data):
    """20 random profiles x clusters (1-3 levels, 2-64 workers), every schedule, with and without memory
    limits, optimizer steps and compute lost to communication: the very same plan (1000: make test-slow)."""
    random_case(data)


def test_synthetic_profiles_on_two_level_clusters_equal_the_exhaustive_dp():
    """Bigger cases of the benchmark's kind: conv front, FC tail, skips, 64 workers on 8 hosts."""
    from benchmarks.partitioner_speed import cluster as bench_cluster
    from benchmarks.partitioner_speed import synthetic_profile
    for nodes, per_host, hosts, schedule in ((40, 8, 4, "1f1b"), (30, 4, 4, "pipedream"), (30, 8, 8, "gpipe")):
        clu = bench_cluster(per_host, hosts)
        workers = clu.total_workers
        same_plan(model_costs(synthetic_profile(nodes, seed=nodes)), clu,
                  Options(get_schedule(schedule), 2 * workers, "adam", 8e9))


@settings(max_examples=150, deadline=None)
@given(clusters(max_workers=48), st.data(), st.booleans())
def test_closed_form_pricing_equals_the_cost_model(cluster, data, dedicated):
    """CostModel.fast_lines gives CostModel.lines' numbers bit for bit, on blocks of copies and on any group."""
    model = CostModel(cluster, aggregator_dedicated=dedicated)
    workers = cluster.total_workers
    if data.draw(st.booleans()):
        ranks = sorted(data.draw(st.sets(st.integers(0, workers - 1), min_size=1)))
    else:
        x = data.draw(st.integers(0, workers - 1))
        ranks = list(range(x, data.draw(st.integers(x + 1, workers))))
    variants = [(a, h) for a in ALGORITHMS for h in ((False, True) if a == "butterfly" else (False,))]
    assert model.fast_lines(ranks) == [(a, model.priced_line(a, ranks, halving=h)) for a, h in variants]
    assert model.lines(ranks) == model.fast_lines(ranks)


def test_closed_form_pricing_is_faster_on_big_blocks():
    from benchmarks.partitioner_speed import cluster as bench_cluster
    ranks = list(range(3, 3 + 683))
    slow, fast = CostModel(bench_cluster(8, 128)), CostModel(bench_cluster(8, 128))
    t0 = time.process_time()
    want = [(a, slow.priced_line(a, ranks, halving=h)) for a in ALGORITHMS
            for h in ((False, True) if a == "butterfly" else (False,))]
    t1 = time.process_time()
    got = fast.fast_lines(ranks)
    t2 = time.process_time()
    assert got == want and (t2 - t1) < (t1 - t0)


@settings(max_examples=60, deadline=None)
@given(st.lists(LAYER, min_size=1, max_size=8), clusters(max_workers=32), st.data())
def test_exposure_row_and_sync_bound(layers, cluster, data):
    """The row formula equals the exposure table bit for bit; the ring bound is above every node's sync."""
    costs = model_costs(make_profile(layers))
    workers = cluster.total_workers
    t = StageTerms(costs, CostModel(cluster), workers, 1, Options(get_schedule("1f1b"), 2 * workers))
    x = data.draw(st.integers(0, workers - 1))
    b = data.draw(st.integers(1, workers - x))
    table = reference_dp.exposure_table(t.block_sync.sync_ms(x % t.period, b), costs.backward_ms, costs.forward_ms)
    for i in range(costs.n):
        np.testing.assert_array_equal(t.block_sync.exposure_row(x % t.period, b, i), table[i, i:])
    top = int(t.level_between(np.array([x]), np.array([x + b - 1]))[0])
    sync = t.block_sync
    a, per_byte = sync.ring_bound[0][b, top], sync.ring_bound[1][b, top]
    assert (sync.sync_ms(x % t.period, b) <= (a + per_byte * costs.param_bytes) * 1e3 * (1 + 1e-12) + 1e-12).all()


def test_time_limit_returns_a_lower_bound_and_the_best_plan_so_far():
    from benchmarks.partitioner_speed import cluster as bench_cluster
    from benchmarks.partitioner_speed import synthetic_profile
    clu = bench_cluster(8, 8)
    costs, model = model_costs(synthetic_profile(60)), CostModel(clu)
    opts = Options(get_schedule("1f1b"), 128, "sgd", 32e9)
    bound = evaluate(costs, model, baseline_stages("dp", costs, 64), opts).objective_ms
    full = dp.solve(costs, model, 64, opts, bound)
    cut = dp.solve(costs, CostModel(clu), 64, opts, bound, deadline=time.monotonic())
    assert not cut.complete and cut.lower_bound_ms <= full.objective_ms
    assert full.complete and full.lower_bound_ms == full.objective_ms


def test_the_time_budget_bounds_a_long_search_and_records_its_gap():
    """100 nodes on 4096 workers searches for ~6.6 s on a quiet machine (50 on 1024, the case this
    test had, now ends in 0.26 s, so it passed only under load); a budget of 0.3 s returns the best
    plan found then, with the bound proven so far, in about that time."""
    from benchmarks.partitioner_speed import cluster as bench_cluster
    from benchmarks.partitioner_speed import synthetic_profile
    from hybridpipe.partitioner.planner import Request, partition
    t0 = time.monotonic()
    out = partition(synthetic_profile(100), bench_cluster(512, 8), Request(time_budget_s=0.3))
    wall = time.monotonic() - t0
    search = out.plan.search
    assert search is not None and not search.complete and search.budget_s == 0.3, search
    assert wall < 0.3 + 5 and search.seconds < wall, (wall, search)
    assert 0 < search.lower_bound_ms <= search.objective_ms and search.gap == pytest.approx(
        search.objective_ms / search.lower_bound_ms - 1, abs=1e-6)


def test_a_search_over_sums_that_overflow_ends():
    """Node times of 1e308 ms (refused at load since issue 31, built here directly) made every sum
    inf and data parallelism's objective nan; the search raised its threshold for ever. A search at
    an infinite threshold has seen every plan: it ends, with none."""
    clu = Cluster((Level("node", 1, 1000.0), Level("net", 4, 1.0)), 16.0)
    costs = model_costs(make_profile([(1e308, 1e308, 4096, 4096)] * 3))
    opts = Options(get_schedule("1f1b"), 8, "sgd", 16e9)
    bound = evaluate(costs, CostModel(clu), baseline_stages("dp", costs, 4), opts).objective_ms
    t0 = time.monotonic()
    with np.errstate(all="ignore"):
        sol = dp.solve(costs, CostModel(clu), 4, opts, bound, deadline=time.monotonic() + 60)
    assert sol.complete and not sol.stages and time.monotonic() - t0 < 30


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_scalable_dp_equals_the_exhaustive_one_many(data):
    random_case(data)
