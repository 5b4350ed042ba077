"""Cuts that would split a value that cannot cross a stage boundary (``ProfileNode.cut_blocker``)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.pipedream import pipedream_stages
from hybridpipe.partitioner.search.strategies import baseline_stages
from hybridpipe.profiles.format import Profile
from tests.partitioner.synth import flat_cluster, make_profile, two_level

LAYERS = [(2.0, 4.0, 1_000_000, 100_000), (3.0, 6.0, 500_000, 2_000_000), (1.0, 2.0, 100_000, 50_000_000),
          (0.5, 1.0, 10_000, 8_000_000), (1.0, 1.0, 10_000, 1_000_000), (2.0, 2.0, 10_000, 0)]   # 8 nodes


def ends(stages):
    return [s.last for s in stages]


def test_profile_field_round_trips_and_older_profiles_load_without_it():
    prof = make_profile(LAYERS[:2], blockers=[1])
    data = prof.to_dict()
    assert data["nodes"][1]["cut_blocker"] == "size1" and data["nodes"][2]["cut_blocker"] is None
    assert Profile.from_dict(json.loads(json.dumps(data))) == prof
    for node in data["nodes"]:
        del node["cut_blocker"]
    old = Profile.from_dict(data)
    assert all(n.cut_blocker is None for n in old.nodes) and old.signature() == prof.signature()
    data["nodes"][1]["cut_blocker"] = 3
    with pytest.raises(UserError, match="cut_blocker"):
        Profile.from_dict(data)


def test_uniform_moves_each_boundary_to_the_nearest_free_cut():
    costs = model_costs(make_profile(LAYERS))
    assert ends(baseline_stages("uniform", costs, 4, stages=4)) == [1, 3, 5, 7]
    blocked = model_costs(make_profile(LAYERS, blockers=[1, 3]))
    assert ends(baseline_stages("uniform", blocked, 4, stages=4)) == [0, 2, 5, 7]     # ties: the earlier cut
    assert ends(baseline_stages("uniform", model_costs(make_profile(LAYERS, blockers=[0, 1, 2, 3])), 2, stages=2)) \
        == [4, 7]


def test_uniform_refuses_in_one_line_when_too_few_cuts_are_free():
    costs = model_costs(make_profile(LAYERS, blockers=[0, 1, 2, 3, 4, 5]))       # only the cut after l6 is free
    with pytest.raises(UserError, match=r"only 2 are possible.*'n'.*--stages 2") as err:
        baseline_stages("uniform", costs, 4, stages=4)
    assert "\n" not in str(err.value)
    assert ends(baseline_stages("uniform", costs, 2, stages=2)) == [6, 7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=8), st.integers(1, 5), st.data())
def test_balanced_sizes_over_free_cuts_equal_brute_force(weights, parts, data):
    n = len(weights)
    parts = min(parts, n)
    free = data.draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    ends_ok = np.array([True, *free, True])
    sizes = balanced_sizes(np.array(weights, dtype=float), [1.0] * parts, ends_ok)
    choices = [c for c in itertools.combinations(range(1, n), parts - 1) if all(ends_ok[x] for x in c)]
    if not choices:
        assert sizes is None
        return

    def worst(cuts):
        bounds = (0, *cuts, n)
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

    assert sizes is not None
    cuts = tuple(int(x) for x in np.cumsum(sizes)[:-1])
    assert all(ends_ok[x] for x in cuts) and worst(cuts) == min(worst(c) for c in choices)


def test_params_time_and_pipedream_never_cut_a_blocked_value():
    blockers = [2, 3, 5]
    costs = model_costs(make_profile(LAYERS, blockers=blockers))
    for strategy in ("params", "time"):
        for parts in (2, 4):
            assert not set(ends(baseline_stages(strategy, costs, parts))[:-1]) & set(blockers)
    for cluster in (flat_cluster(4, gbps=0.5), two_level(2, 2, outer_gbps=0.5)):
        found = pipedream_stages(costs, cluster)
        assert found is not None and not set(ends(found)[:-1]) & set(blockers)


@pytest.mark.parametrize("strategy", ["optimal", "pipedream", "dp", "uniform", "params", "time"])
def test_every_strategy_plans_around_blocked_cuts(strategy):
    blockers = [1, 2, 4]
    prof = make_profile(LAYERS, blockers=blockers)
    plan = partition(prof, flat_cluster(4, gbps=1.0), Request(strategy=strategy, micro_batches=8)).plan
    assert not {s.last_node for s in plan.stages[:-1]} & set(blockers)
