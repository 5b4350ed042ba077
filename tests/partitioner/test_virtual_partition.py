"""`partition --schedule interleaved-1f1b|zbv --virtual-stages V`: the chunk DP against brute force,
memory per worker against what the instruction lists hold, the plan's layout, its simulated
step, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.cli import main
from hybridpipe.errors import UserError
from hybridpipe.partitioner.chunk_orders import Place
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.stagememory import memory_bytes
from hybridpipe.pipeline.instructions import Backward, BackwardWeight, Forward
from hybridpipe.pipeline.schedules import Topology, all_programs
from hybridpipe.pipeline.simulator import simulate
from hybridpipe.pipeline.validate import validate
from hybridpipe.profiles.format import save_profile
from tests.partitioner.synth import compositions, flat_cluster, make_profile
from tests.pipeline.test_virtual_format import virtual_topology


def step_of(plan: Plan) -> float:
    return simulate(plan).step_ms


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), data=st.data())
def test_the_chunk_dp_is_optimal_by_brute_force(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    divisors = data.draw(st.lists(st.integers(1, 3), min_size=parts, max_size=parts))
    ends_ok = np.array([True, *data.draw(st.lists(st.booleans(), min_size=len(weights), max_size=len(weights)))])
    ends_ok[-1] = True
    w = np.array(weights)

    def worst(sizes):
        bounds = np.cumsum([0, *sizes])
        return max(w[bounds[c]:bounds[c + 1]].sum() / divisors[c] for c in range(parts))
    feasible = [s for s in compositions(len(w), parts) if all(ends_ok[b] for b in np.cumsum(s))]
    got = balanced_sizes(w, divisors, ends_ok)
    if not feasible:
        assert got is None
        return
    assert got is not None and all(ends_ok[b] for b in np.cumsum(got)) and sum(got) == len(w) and min(got) >= 1
    assert worst(got) == pytest.approx(min(worst(s) for s in feasible), abs=1e-9)


@pytest.mark.parametrize(("schedule", "virtual", "replicas"), [
    ("interleaved-1f1b", 2, [1, 1, 1]), ("interleaved-1f1b", 3, [2, 1]), ("zbv", 2, [1, 2, 1]), ("zbv", 2, [2, 2]),
])
def test_the_schedule_counts_what_each_chunk_holds_as_the_lists_do(schedule, virtual, replicas):
    """Schedule.chunk_inflight (ops) equals the validator's count on the expanded instruction lists."""
    kind, M = get_schedule(schedule), 8
    topo = virtual_topology(schedule, replicas, virtual, M)
    report = validate(topo, [all_programs(topo, get_schedule(schedule))])
    for g, ranks in enumerate(topo.groups):
        held = kind.chunk_inflight(Place(g, tuple(replicas), M), virtual)
        assert held == tuple(report.max_in_flight_stage[(ranks[0], s)] for s in topo.stages_of(ranks[0]))


def peak_held(program, per_micro_batch: dict[int, float], split: bool) -> float:
    """The most activation bytes a rank's instruction list holds at once: a forward adds its chunk's
    micro-batch, the backward that ends it (the weight half of a split one) releases it."""
    done = BackwardWeight if split else Backward
    now = most = 0.0
    for ins in program:
        if isinstance(ins, (Forward, done)):
            now += per_micro_batch[ins.stage] * (1 if isinstance(ins, Forward) else -1)
            most = max(most, now)
    return most


def test_a_workers_peak_is_below_the_sum_of_its_chunks_peaks():
    """The chunks' own peaks come at different times (zbv: the first chunk's in the warm-up, the
    second's in the steady state), so the worker's peak is lower than their sum."""
    kind, place, per_mb = get_schedule("zbv"), Place(0, (1, 1), 4), [1.0, 1.0]
    assert kind.held_peak(place, 2, per_mb) < sum(kind.chunk_inflight(place, 2))


LAYERS = [(1.0 + (k % 3), 2.0 + (k % 2), 4096, 40_000) for k in range(16)]


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2)])
def test_a_virtual_plan_keeps_the_strategys_groups_and_is_simulated(schedule, virtual):
    profile = make_profile(LAYERS)
    cluster = flat_cluster(4, gbps=10.0)
    req = Request(strategy="uniform", stages=2, micro_batches=8, schedule=schedule, virtual_stages=virtual)
    base = partition(profile, cluster, dataclasses.replace(req, schedule="1f1b", virtual_stages=1)).plan
    out = partition(profile, cluster, req, simulate=step_of)
    plan = out.plan
    assert Plan.from_dict(plan.to_dict()) == plan and plan.virtual_stages == virtual and plan.schedule == schedule
    groups = [s.ranks for s in base.stages]
    kind = get_schedule(schedule)
    assert [s.ranks for s in plan.stages] == [groups[kind.group_of(c, 2)] for c in range(2 * virtual)]
    assert plan.stages[0].first_node == 0 and plan.stages[-1].last_node == len(profile.nodes) - 1
    assert all(a.last_node + 1 == b.first_node for a, b in zip(plan.stages, plan.stages[1:], strict=False))
    # memory per worker: every chunk's weights and state, plus the activations at the worker's peak over
    # its chunks together, counted on the rank's own instruction list
    costs, opts = model_costs(profile), Options(get_schedule(schedule), 8)
    topo = Topology.from_plan(plan)
    programs = all_programs(topo, get_schedule(schedule))
    for ranks in groups:
        mine = {i: s for i, s in enumerate(plan.stages) if s.ranks == ranks}
        static = sum(memory_bytes(costs, s.first_node, s.last_node, 0, opts) for s in mine.values())
        want = static + peak_held(programs[ranks[0]], {i: costs.stash_bytes(s.first_node, s.last_node)
                                                       for i, s in mine.items()}, kind.split_backward)
        assert all(s.memory_bytes == int(want) for s in mine.values())
    assert plan.predicted_step_ms == pytest.approx(simulate(plan).step_ms + sum(t.predicted_ms for t in plan.tied))
    assert plan.predicted_samples_per_s == pytest.approx(8 * plan.batch_size / plan.predicted_step_ms * 1e3)


def test_interleaving_beats_1f1b_on_a_balanced_model_with_few_micro_batches():
    profile = make_profile([(1.0, 2.0, 1024, 4000)] * 16)
    cluster = flat_cluster(4, gbps=100.0)
    req = Request(strategy="uniform", stages=4, micro_batches=4)
    one = partition(profile, cluster, req).plan
    inter = partition(profile, cluster, dataclasses.replace(req, schedule="interleaved-1f1b", virtual_stages=2),
                      simulate=step_of).plan
    assert inter.predicted_step_ms < 0.9 * simulate(one).step_ms
    auto = partition(profile, cluster, dataclasses.replace(req, schedule="auto", virtual_stages=2), simulate=step_of)
    assert auto.plan.virtual_stages == 2
    assert partition(profile, cluster, dataclasses.replace(req, schedule="auto")).plan.virtual_stages == 1


def test_a_worker_whose_chunks_do_not_fit_is_refused_and_recompute_helps():
    profile = make_profile([(1.0, 2.0, 4_000_000, 4000)] * 8)
    req = Request(strategy="uniform", stages=2, micro_batches=8, schedule="interleaved-1f1b", virtual_stages=2)
    roomy = partition(profile, flat_cluster(2), req, simulate=step_of).plan
    need = max(s.memory_bytes for s in roomy.stages)
    with pytest.raises(UserError, match="does not fit: the workers of stage .* --recompute auto"):
        partition(profile, flat_cluster(2, memory_gb=need * 0.9 / 1e9), req, simulate=step_of)
    tight = partition(profile, flat_cluster(2, memory_gb=need * 0.9 / 1e9),
                      dataclasses.replace(req, recompute="auto"), simulate=step_of).plan
    assert any(s.recompute for s in tight.stages) and max(s.memory_bytes for s in tight.stages) <= need * 0.9


@pytest.fixture()
def profile_file(tmp_path):
    return save_profile(make_profile(LAYERS), tmp_path / "p.json")


@pytest.fixture()
def cluster_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"kind": "cluster", "format": 1, "levels": [{"name": "net", "workers": 4, '
                    '"bandwidth_gbps": 10}], "memory_gb": 16}')
    return path


@pytest.mark.parametrize(("args", "why"), [
    (["--virtual-stages", "2"], "--virtual-stages 2 needs a schedule with several model chunks per rank"),
    (["--schedule", "zbv"], "--schedule zbv runs several model chunks per rank; give --virtual-stages V"),
    (["--schedule", "zbv", "--virtual-stages", "3"], "--schedule zbv runs 2 \\(the V shape\\) model chunks per rank"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "8", "--strategy", "time"],
     "too few for 4 stages x 8 virtual stages"),
])
def test_impossible_combinations_are_refused_in_one_line(profile_file, cluster_file, capsys, args, why):
    assert main(["partition", str(profile_file), "--cluster", str(cluster_file), "-q", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(why, err), err


def test_partition_writes_a_virtual_plan_that_simulate_and_schedule_read(profile_file, cluster_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile_file), "--cluster", str(cluster_file), "-q", "--strategy", "uniform",
                 "--stages", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "schedule interleaved-1f1b (2 chunks per worker)" in printed and "step predicted by simulation" in printed
    plan = Plan.from_dict(json.loads(out.read_text()))
    assert len(plan.stages) == 4 and Topology.from_plan(plan).virtual_stages == 2
    assert main(["simulate", str(out)]) == 0
    assert math.isfinite(simulate(plan).step_ms)
    assert main(["schedule", str(out), "--rank", "0"]) == 0
    assert "stages 0, 2" in capsys.readouterr().out
