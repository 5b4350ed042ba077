"""The plan is the contract: every plan any strategy writes runs, and runs exactly as written.

Random small models read a size (an int) or a shape (a tuple of ints) at one depth and use it at a
later one, so non-tensor values cross cuts; every strategy's plan for 4 workers must run (threads
and the in-process transport; tests/runtime covers real processes) and equal single-process SGD.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.plan import STRATEGIES
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.search.layersplit import LAYER_SPLITS, layer_split_sizes
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import max_diff, train_pipeline, train_reference

CLUSTER = Cluster((Level("local", 4, 8.0, 500.0),), 4.0)


def model_spec(depth: int, take: int, use: int, kind: str) -> str:
    return f"tests.pipeline.contract_models:reads_shape_early[depth={depth},take={take},use={use},kind={kind}]"


def layer_stages(strategy: str, profile) -> int:
    """The most stages (of 4, 2, 1: they divide the 4 workers) the layer-count rule accepts for this model."""
    for stages in (4, 2, 1):
        try:
            layer_split_sizes(strategy, [n.name for n in profile.nodes], stages)
            return stages
        except UserError:
            continue
    raise AssertionError(f"{strategy} refuses even one stage")


def check_every_strategy(spec: str, granularity: str) -> None:
    profile = profile_model(resolve_model(spec), batch_size=4, repeats=1, warmup=0, progress=False,
                            granularity=granularity)
    for strategy in STRATEGIES:
        stages = 2 if strategy in ("uniform", "params") else None
        if strategy in LAYER_SPLITS:
            stages = layer_stages(strategy, profile)
        plan = partition(profile, CLUSTER, Request(workers=4, strategy=strategy, micro_batches=4,
                                                   stages=stages)).plan
        ours, _ = train_pipeline(plan, 2)
        assert max_diff(ours, train_reference(plan, 2)) <= 1e-5, (strategy, [(s.first_node, s.last_node)
                                                                               for s in plan.stages])


def test_every_strategy_writes_a_plan_that_runs_with_a_shape_crossing_cuts():
    check_every_strategy(model_spec(5, 0, 4, "shape"), "ops")


@pytest.mark.slow
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(3, 7), data=st.data(), kind=st.sampled_from(["size", "shape"]),
       granularity=st.sampled_from(["blocks", "ops"]))
def test_every_strategy_writes_a_plan_that_runs_and_equals_one_process(depth, data, kind, granularity):
    take = data.draw(st.integers(0, depth - 2))
    use = data.draw(st.integers(take + 1, depth - 1))
    check_every_strategy(model_spec(depth, take, use, kind), granularity)


@pytest.mark.parametrize("kind", ["size", "shape"])
def test_a_size_read_early_crosses_every_cut_to_where_it_is_used(kind):
    """Cut after every block: the int (or tuple) travels through every stage in between."""
    spec = model_spec(6, 0, 5, kind)
    profile = profile_model(resolve_model(spec), batch_size=4, repeats=1, warmup=0, progress=False)
    plan = partition(profile, CLUSTER, Request(workers=4, strategy="uniform", stages=4, micro_batches=4)).plan
    assert len(plan.stages) == 4
    ours, _ = train_pipeline(plan, 2)
    assert max_diff(ours, train_reference(plan, 2)) <= 1e-5
