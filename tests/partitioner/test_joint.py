"""The joint search (schedule x virtual stages x precision with the stages) against brute force."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.wire import activation_wire
from hybridpipe.partitioner.joint import AUTO_VIRTUAL, Choice, choices, joint_partition
from hybridpipe.partitioner.plan import Plan, load_plan
from hybridpipe.partitioner.planner import Request, build_plan, partition, resolve, simulated_ms
from hybridpipe.partitioner.schedule_registry import REGISTRY
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.virtual import virtual_plan
from hybridpipe.pipeline.simulator import simulate
from hybridpipe.profiles.format import save_profile
from tests.partitioner.synth import compositions, flat_cluster, make_profile


def step_of(plan: Plan) -> float:
    return simulate(plan).step_ms


def brute_force(profile, cluster, req: Request) -> float:
    """The fastest simulated step over every schedule, V and precision, and for V > 1 every split of the
    workers into contiguous groups (written out here, not the search's candidate list). V goes up to
    half the nodes, as the search's does (joint.choices: more chunks than that fit only a single group,
    data parallelism cut into chunks; one such plan here was 5e-6 ms faster than the search's)."""
    best = float("inf")
    workers = cluster.total_workers
    for name, kind in REGISTRY.items():
        if not kind.flushed:
            continue
        for virtual in range(1, max(1, min(4, len(profile.nodes) // 2)) + 1):
            if not kind.virtual_ok(virtual) or kind.chunked != (virtual > 1):
                continue
            for precision in ("fp32", "bf16"):
                sub = dataclasses.replace(req, schedule=name, virtual_stages=virtual, precision=precision)
                if virtual == 1:
                    try:
                        best = min(best, simulated_ms(partition(profile, cluster, sub), step_of))
                    except UserError:
                        pass
                    continue
                cl, _, opts = resolve(cluster, dataclasses.replace(sub, schedule="1f1b", virtual_stages=1))
                opts = dataclasses.replace(opts, schedule=kind)
                model = CostModel(cl, activation_wire_bytes=activation_wire(precision, profile.precision))
                costs = model_costs(profile).slowed(model.compute_slowdown)
                for p in range(1, workers + 1):
                    for sizes in compositions(workers, p):
                        bounds = [0, *itertools.accumulate(sizes)]
                        groups = [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]

                        def build(specs, ev, o, cl=cl, costs=costs, model=model, precision=precision):
                            return build_plan(profile, costs, cl, specs, ev, o, "optimal", model, precision=precision)
                        try:
                            _, ev = virtual_plan(groups, costs, model, opts, virtual, build, step_of)
                        except UserError:
                            continue
                        best = min(best, ev.objective_ms)
    return best


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.lists(st.tuples(st.floats(0.5, 4.0), st.floats(0.5, 8.0), st.integers(1_000, 2_000_000),
                                 st.integers(1_000, 4_000_000)), min_size=3, max_size=6),
       workers=st.integers(2, 4), micro=st.sampled_from([4, 8]), gbps=st.sampled_from([0.5, 10.0]))
def test_the_joint_search_equals_brute_force(layers, workers, micro, gbps):
    profile = make_profile(layers)
    cluster = flat_cluster(workers, gbps=gbps)
    req = Request(schedule="auto", virtual_stages=AUTO_VIRTUAL, precision="auto", micro_batches=micro)
    try:
        joint = joint_partition(profile, cluster, req, simulate=step_of)
    except UserError:
        assert brute_force(profile, cluster, req) == float("inf")
        return
    found = min(t.step_ms for t in joint.tried if t.step_ms is not None)
    plan = joint.outcome.plan
    step = joint.outcome.evaluation.objective_ms if plan.virtual_stages > 1 else simulated_ms(joint.outcome, step_of)
    assert step == found
    assert found == pytest.approx(brute_force(profile, cluster, req), rel=1e-12)


def test_choices_are_every_schedule_with_the_chunks_it_runs():
    got = choices("auto", AUTO_VIRTUAL, "fp32", nodes=6)
    assert [(c.schedule, c.virtual) for c in got] == [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                                      ("interleaved-1f1b", 2), ("zbv", 2), ("interleaved-1f1b", 3)]
    assert choices("1f1b", 1, "auto", nodes=6) == [Choice("1f1b", 1, "fp32"), Choice("1f1b", 1, "bf16")]


def test_auto_weighs_virtual_stages_without_being_told(tmp_path, capsys):
    # a balanced model on 4 stages with few micro-batches: interleaving shrinks the bubble, so auto picks it unasked
    profile = save_profile(make_profile([(1.0, 2.0, 1024, 4000)] * 16), tmp_path / "p.json")
    cluster = tmp_path / "c.json"
    cluster.write_text('{"kind": "cluster", "format": 1, "levels": [{"name": "net", "workers": 4, '
                       '"bandwidth_gbps": 100}], "memory_gb": 16}')
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile), "--cluster", str(cluster), "--micro-batches", "4", "--schedule", "auto",
                 "--strategy", "uniform", "--stages", "4",
                 "-q", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.virtual_stages > 1 and "joint search" in capsys.readouterr().out
    told = main(["partition", str(profile), "--cluster", str(cluster), "--micro-batches", "4", "--schedule", "auto",
                 "--strategy", "uniform", "--stages", "4",
                 "--virtual-stages", "1", "-q", "-o", str(tmp_path / "one.json")])
    assert told == 0 and load_plan(tmp_path / "one.json").virtual_stages == 1
    assert plan.predicted_step_ms < load_plan(tmp_path / "one.json").predicted_step_ms


def test_a_cluster_too_big_to_simulate_plans_one_chunk_per_worker_and_says_so():
    profile = make_profile([(1.0, 2.0, 1024, 4000)] * 6)
    req = Request(schedule="auto", virtual_stages=AUTO_VIRTUAL)          # 256 workers x 512 micro-batches
    joint = joint_partition(profile, flat_cluster(256, gbps=10.0), req, simulate=step_of)
    assert joint.outcome.plan.virtual_stages == 1 and joint.tried == ()
    assert any("virtual stages not searched" in n for n in joint.outcome.notes)
