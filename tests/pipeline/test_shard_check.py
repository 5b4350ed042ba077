"""Sharded replicas' plans the runtime cannot run are refused at start-up in one line, not after a hang.

* ZeRO-3 (shard "parameters"): the replicas of a stage all-gather each unit's weights for every
  forward (and regather them for every backward when resharding after the forward), so the n-th
  gather of every replica is one collective. With a different replica count on another stage the
  replicas' lists are one pipeline's order cut apart; the validator, told of the gathers, finds
  where a replica in a gather waits for one whose micro-batch waits on the first (zbv with 1 and
  3 replicas, 1f1b with 1, 3 and 1). Measured before the check: those plans hung until the 60 s
  timeout on real ranks (tests/runtime/test_combo_audit.py), while 1f1b with 1 and 3 replicas and
  zbv with 1 and 2, which the validator passes, trained as one process.
* ZeRO-2/3 reduce-scatter per micro-batch: micro-batches that are not a multiple of the replicas
  give one replica fewer reduce-scatters than another (2 x 2 replicas, 3 micro-batches: hung).
"""

from __future__ import annotations

import dataclasses

import pytest

from hybridpipe.errors import UserError
from hybridpipe.pipeline.plancheck import check_shards
from hybridpipe.pipeline.schedules import Topology, all_programs
from hybridpipe.pipeline.validate import ScheduleError, validate
from tests.pipeline.harness import make_plan

MLP = "mlp"         # 7 blocks


def sharded(plan, level: str, reshard: bool = True):
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=level, reshard_after_forward=reshard)
                                                  for s in plan.stages))


def plan_of(schedule: str, replicas: list[int], M: int):
    virtual = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
    cuts = {1: {2: [3], 3: [1, 3]}, 2: {2: [1, 3, 4]}}[virtual][len(replicas)]
    return make_plan(MLP, cuts, replicas, schedule=schedule, micro_batches=M, batch_size=2, virtual_stages=virtual)


def test_the_validator_finds_the_gather_deadlock_the_lists_alone_do_not_have():
    plan = plan_of("zbv", [1, 3], 6)
    topo = Topology.from_plan(plan)
    lists = [all_programs(topo, plan.kind)]
    validate(topo, lists)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(topo, lists, gathers={1: "each", 2: "each"})
    validate(topo, lists, gathers={1: "first", 2: "first"})   # gathered once a step: all first forwards meet


@pytest.mark.parametrize("schedule, replicas, M, reshard", [
    ("zbv", [1, 3], 6, True), ("zbv", [2, 1], 4, True), ("zbv", [3, 1], 6, False), ("1f1b", [1, 3, 1], 6, True),
    ("interleaved-1f1b", [1, 3], 6, True)])
def test_zero3_plans_whose_gathers_deadlock_are_refused_in_one_line(schedule, replicas, M, reshard):
    plan = sharded(plan_of(schedule, replicas, M), "parameters", reshard)
    with pytest.raises(UserError, match="would deadlock in the weight gathers") as e:
        check_shards(plan)
    assert "\n" not in str(e.value)
    for level in ("optimizer", "gradients"):
        check_shards(sharded(plan, level))          # no per-micro-batch gathers: runs (zbv [1, 3] ZeRO-2 measured)


@pytest.mark.parametrize("schedule, replicas, M", [
    ("1f1b", [1, 3], 6), ("zbv", [1, 2], 4), ("zbv", [2, 2], 4), ("interleaved-1f1b", [2, 2], 4), ("zb-h1", [2, 2], 4),
    ("gpipe", [3, 3], 6)])
def test_zero3_plans_that_run_are_accepted(schedule, replicas, M):
    for reshard in (True, False):
        check_shards(sharded(plan_of(schedule, replicas, M), "parameters", reshard))


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_per_micro_batch_reduce_scatters_need_a_multiple_of_the_replicas(level):
    plan = sharded(plan_of("1f1b", [2, 2], 3), level)
    with pytest.raises(UserError, match="use a multiple of 2 micro-batches \\(not 3\\)"):
        check_shards(plan)
    check_shards(sharded(plan, "optimizer"))        # one reduce-scatter a step
    check_shards(sharded(plan, "none"))


def test_partition_never_hands_on_a_plan_whose_gathers_deadlock():
    """commands/runnable.py: the planner prices one stage at a time, so the command checks the plan it chose.
    Under --shard auto a deadlocking ZeRO-3 choice is planned again without ZeRO-3 (with a note); under
    --shard parameters it is refused in one line, as launch would. The planner's choice here is the
    zbv 1 + 3 plan that hung on real ranks (test_combo_audit), put in a real Outcome of the search."""
    from hybridpipe.commands.runnable import ZERO3_NOTE, runnable
    from hybridpipe.partitioner.planner import Request, partition
    from tests.partitioner.synth import flat_cluster, make_profile

    deadlocking = sharded(plan_of("zbv", [1, 3], 6), "parameters")
    asked: list[Request] = []
    real = partition(make_profile([(1.0, 2.0, 1000, 4000)] * 4, []), flat_cluster(4), Request(micro_batches=6))

    def plan_for(req: Request):
        asked.append(req)
        chosen = deadlocking if req.zero3 else sharded(deadlocking, "gradients")
        return dataclasses.replace(real, plan=chosen)

    got = runnable(plan_for, Request(shard="auto"))
    assert [r.zero3 for r in asked] == [True, False] and got.notes[-1] == ZERO3_NOTE
    assert {s.shard for s in got.plan.stages if s.replicas > 1} == {"gradients"}
    asked.clear()
    with pytest.raises(UserError, match="would deadlock in the weight gathers"):
        runnable(plan_for, Request(shard="parameters"))
    assert len(asked) == 1
    fine = sharded(plan_of("1f1b", [1, 3], 6), "parameters")
    assert runnable(lambda req: dataclasses.replace(real, plan=fine), Request(shard="auto")).plan is fine
