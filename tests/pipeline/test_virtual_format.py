"""Virtual stages, the data side: the plan's ``virtual_stages`` (load, save, layout checks),
Topology.stages_of, every instruction's ``stage`` and message keys naming the producing stage."""

from __future__ import annotations

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.partitioner.schedule_registry import REGISTRY, get_schedule
from hybridpipe.pipeline.instructions import RECEIVES, SENDS, SyncWait, message_key
from hybridpipe.pipeline.schedules import Topology, all_programs, eval_program, rank_program, transfer_program


def virtual_topology(schedule: str, replicas: list[int], virtual: int, micro_batches: int) -> Topology:
    """Groups of ``replicas`` ranks laid out as ``schedule`` puts p * ``virtual`` stages."""
    groups, first = [], 0
    for r in replicas:
        groups.append(tuple(range(first, first + r)))
        first += r
    kind, p = get_schedule(schedule), len(replicas)
    return Topology(tuple(groups[kind.group_of(s, p)] for s in range(p * virtual)), micro_batches)


def plan_for(topo: Topology, schedule: str, virtual: int) -> Plan:
    stages = tuple(Stage(index=s, first_node=s, last_node=s, replicas=len(ranks), ranks=ranks)
                   for s, ranks in enumerate(topo.stage_ranks))
    return Plan(model="mlp", batch_size=2, input_shape=(2, 8), profile_signature="x",
                cluster=Cluster((Level("node", 8, 100.0),), 16.0), strategy="uniform", schedule=schedule,
                micro_batches=topo.micro_batches, optimizer="sgd", stages=stages, virtual_stages=virtual)


def test_old_plans_load_with_one_chunk_per_rank_and_virtual_plans_round_trip():
    plan = plan_for(Topology(((0,), (1, 2)), 4), "1f1b", 1)
    old = plan.to_dict()
    del old["virtual_stages"]
    assert Plan.from_dict(old).virtual_stages == 1
    looped = plan_for(virtual_topology("interleaved-1f1b", [1, 2], 3, 4), "interleaved-1f1b", 3)
    again = Plan.from_dict(looped.to_dict())
    assert again == looped and again.world_size == 3 and len(again.stages) == 6
    chunks, replica = again.stages_of_rank(2)
    assert [s.index for s in chunks] == [1, 3, 5] and replica == 1
    with pytest.raises(ValueError, match="stages_of_rank"):
        again.stage_of_rank(2)
    vee = plan_for(virtual_topology("zbv", [2, 1, 1], 2, 4), "zbv", 2)
    assert [s.ranks for s in Plan.from_dict(vee.to_dict()).stages] == [(0, 1), (2,), (3,), (3,), (2,), (0, 1)]


@pytest.mark.parametrize(("schedule", "virtual", "ranks", "why"), [
    ("1f1b", 2, [(0,), (1,), (0,), (1,)], "runs 1 \\(no virtual stages\\) model chunks per rank, not 2"),
    ("zbv", 3, [(0,), (1,), (1,), (0,), (0,), (1,)], "runs 2 \\(the V shape\\) model chunks per rank, not 3"),
    ("interleaved-1f1b", 2, [(0,), (1,), (1,), (0,)], "stage 2 runs on ranks \\[1\\] but .* group 0"),
    ("zbv", 2, [(0,), (1,), (0,), (1,)], "stage 2 runs on ranks \\[0\\] but .* group 1"),
    ("interleaved-1f1b", 2, [(0, 1), (1, 2), (0, 1), (1, 2)], "disjoint"),
    ("interleaved-1f1b", 2, [(0,), (1,), (0,)], "3 stages cannot be 2 chunks"),
])
def test_a_plan_whose_chunks_do_not_match_the_schedule_is_refused_in_one_line(schedule, virtual, ranks, why):
    topo = Topology(tuple(ranks), 4)
    data = plan_for(Topology(((0,),), 4), "1f1b", 1).to_dict()
    data.update(schedule=schedule, virtual_stages=virtual,
                stages=[plan_for(topo, schedule, virtual).stages[s].__dict__ | {"ranks": list(r), "layers": []}
                        for s, r in enumerate(ranks)])
    with pytest.raises(UserError, match=why) as err:
        Plan.from_dict(data)
    assert "\n" not in str(err.value)


def test_topology_knows_each_ranks_chunks():
    topo = virtual_topology("interleaved-1f1b", [2, 1], 3, 4)
    assert topo.groups == ((0, 1), (2,)) and topo.virtual_stages == 3 and topo.world_size == 3
    assert topo.stages_of(1) == (0, 2, 4) and topo.stages_of(2) == (1, 3, 5) and topo.replica_of(1) == 1
    with pytest.raises(ValueError, match="stages_of"):
        topo.locate(0)
    assert Topology(((0,), (1, 2)), 4).locate(2) == (1, 1)


@pytest.mark.parametrize("schedule", [s for s in REGISTRY if not REGISTRY[s].chunked])
def test_every_instruction_of_the_one_chunk_schedules_names_the_ranks_stage(schedule):
    topo = Topology(((0,), (1, 2), (3,)), 4)
    for rank in range(4):
        stage = topo.locate(rank)[0]
        for prog in (rank_program(topo, rank, get_schedule(schedule)), eval_program(topo, rank)):
            assert {ins.stage for ins in prog if hasattr(ins, "stage")} == {stage}
            assert all(hasattr(ins, "stage") for ins in prog if type(ins).__name__ != "Step")


def test_message_keys_name_the_producing_stage_and_two_chunks_on_one_link_never_collide():
    topo = virtual_topology("interleaved-1f1b", [1, 1], 2, 4)      # rank 1 -> rank 0: act of stage 1, grads of 0 and 2
    progs = all_programs(topo, get_schedule("interleaved-1f1b"))
    sent = {(r, ins.peer, message_key(ins, ins.micro_batch, 4)) for r, p in progs.items() for ins in p
            if isinstance(ins, SENDS)}
    received = {(ins.peer, r, message_key(ins, ins.micro_batch, 4)) for r, p in progs.items() for ins in p
                if isinstance(ins, RECEIVES)}
    assert sent == received
    assert {k for a, b, k in sent if (a, b) == (1, 0)} == {f"{kind}/{s}/{m}" for m in range(4)
                                                           for kind, s in (("act", 1), ("grad", 0), ("grad", 2))}
    keys = {k for _, _, k in transfer_program(topo, 0, get_schedule("interleaved-1f1b"))}
    assert keys >= {"act/0/0", "act/2/3", "grad/2/1"}


def test_each_chunk_syncs_its_replicas_and_all_are_waited_for_before_the_step():
    topo = virtual_topology("interleaved-1f1b", [2, 2], 2, 4)
    prog = rank_program(topo, 0, get_schedule("interleaved-1f1b"))
    starts = [ins.stage for ins in prog if type(ins).__name__ == "SyncStart"]
    assert sorted(starts) == [0, 2]
    assert prog[-3:-1] == [SyncWait(s) for s in starts] and type(prog[-1]).__name__ == "Step"
