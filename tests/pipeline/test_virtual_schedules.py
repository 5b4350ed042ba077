"""interleaved-1f1b and zbv as instruction lists, checked without processes: the op orders equal
torch's own (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble) where both are defined, and every
list set is valid (every send received, no cycle of waits, each micro-batch forwarded and
backwarded once per stage, one optimizer step) for 1..8 groups, 1..16 micro-batches, V 1..4
(zbv: 2), exhaustively without replicas and drawn by hypothesis with replicas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from hybridpipe.errors import UserError
from hybridpipe.partitioner.chunk_orders import Place, interleaved_ops, zbv_ops
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.schedules import Topology, all_programs, check_schedulable
from hybridpipe.pipeline.validate import validate
from tests.pipeline.test_virtual_format import virtual_topology

TORCH_OPS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}


def torch_order(schedule: type, p: int, virtual: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's per-rank compute order, from the schedule's own generator (no process group needed)."""
    s = schedule.__new__(schedule)
    s.pp_group_size, s.n_local_stages, s.rank, s._n_microbatches = p, virtual, rank, micro_batches
    s.num_stages = p * virtual
    s.number_of_rounds = max(1, micro_batches // p)
    s.microbatches_per_round = micro_batches // s.number_of_rounds
    return [(TORCH_OPS[a.computation_type.name], a.microbatch_index, a.stage_index)
            for a in s._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("p", range(1, 7))
def test_the_interleaved_order_is_megatrons_as_torch_writes_it(p):
    for virtual in range(1, 5):
        for m in range(1, 17):
            if m % max(1, m // p):
                continue        # torch asks M to be a multiple of its rounds; ours needs no multiple
            for g in range(p):
                ours = [(op, mb, g + v * p) for op, mb, v in interleaved_ops(range(m), Place(g, (1,) * p, m), virtual)]
                assert ours == torch_order(ScheduleInterleaved1F1B, p, virtual, m, g), (p, virtual, m, g)


@pytest.mark.parametrize("p", range(1, 9))
def test_the_zbv_order_is_torchs(p):
    for m in range(1, 17):
        for g in range(p):
            ours = [(op, mb, g if v == 0 else 2 * p - 1 - g) for op, mb, v in zbv_ops(range(m), Place(g, (1,) * p, m))]
            assert ours == torch_order(ScheduleZBVZeroBubble, p, 2, m, g), (p, m, g)


def check_valid(topo: Topology, schedule: str) -> None:
    """Valid lists (validate raises otherwise) in which every stage forwards and backwards each
    micro-batch once, and every rank steps once with the gradients x 1/M."""
    programs = all_programs(topo, get_schedule(schedule))
    report = validate(topo, [programs])
    M = topo.micro_batches
    assert all(report.steps[rank] == [pytest.approx(1 / M)] for rank in programs)
    for s, ranks in enumerate(topo.stage_ranks):
        fwd = sorted(ins.micro_batch for r in ranks for ins in programs[r]
                     if type(ins).__name__ == "Forward" and ins.stage == s)
        assert fwd == list(range(M)), (s, fwd)


@pytest.mark.parametrize("p", range(1, 9))
def test_every_interleaved_and_zbv_list_set_is_valid_without_replicas(p):
    for m in range(1, 17):
        for virtual in range(1, 5):
            check_valid(virtual_topology("interleaved-1f1b", [1] * p, virtual, m), "interleaved-1f1b")
        check_valid(virtual_topology("zbv", [1] * p, 2, m), "zbv")


@settings(max_examples=150, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=6), virtual=st.integers(1, 4), data=st.data(),
       schedule=st.sampled_from(["interleaved-1f1b", "zbv"]))
def test_every_list_set_is_valid_with_replicas(replicas, virtual, data, schedule):
    """Groups of unequal replica counts too: a replica of r takes the micro-batches m % r == j."""
    m = data.draw(st.integers(max(replicas), 16))
    check_valid(virtual_topology(schedule, replicas, 2 if schedule == "zbv" else virtual, m), schedule)


def test_megatrons_warm_up_is_what_the_first_rank_holds():
    """Megatron's first rank holds (V-1) p + 2 (p-1) + 1 micro-batch chunks at its peak (M % p == 0)."""
    for p, virtual, m in [(4, 2, 8), (4, 3, 16), (2, 4, 8), (8, 2, 16)]:
        topo = virtual_topology("interleaved-1f1b", [1] * p, virtual, m)
        held = validate(topo, [all_programs(topo, get_schedule("interleaved-1f1b"))]).max_in_flight
        assert held[0] == min(virtual * m, (virtual - 1) * p + 2 * (p - 1) + 1)
        assert held[p - 1] == min(virtual * m, (virtual - 1) * p + 1)


def test_a_topology_the_virtual_schedules_cannot_run_is_refused_in_one_line():
    with pytest.raises(UserError, match="zbv runs 2 \\(the V shape\\) model chunks per rank, not 3"):
        check_schedulable(virtual_topology("interleaved-1f1b", [1, 1], 3, 4), get_schedule("zbv"))
    with pytest.raises(UserError, match="--micro-batches >= 3"):
        check_schedulable(virtual_topology("zbv", [3, 1], 2, 2), get_schedule("zbv"))
