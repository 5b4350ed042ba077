"""The step's news on gradient frames (pipeline/stepnews.py): the pure check over every rank's list,
and the engine carrying it in process (threads per rank): every rank holds the loss rank's very note
before its update, and training is bitwise what it is without the news."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.instructions import (
    Backward,
    Forward,
    LoadTarget,
    Loss,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
)
from hybridpipe.pipeline.schedules import Topology, all_programs
from hybridpipe.pipeline.stepnews import NewsRoute, carried_by, news_routes
from tests.pipeline.harness import make_plan, train_pipeline


def topology(replicas: list[int], micro_batches: int = 4) -> Topology:
    ranks, r = [], 0
    for k in replicas:
        ranks.append(tuple(range(r, r + k)))
        r += k
    return Topology(tuple(ranks), micro_batches)


def routes(replicas: list[int], schedule: str, micro_batches: int = 4) -> dict[int, NewsRoute] | None:
    return news_routes(all_programs(topology(replicas, micro_batches), get_schedule(schedule), drain=False))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_plain_chain_carries_the_news_to_every_rank(schedule, stages):
    got = routes([1] * stages, schedule)
    assert got is not None and sorted(got) == list(range(stages))
    last = stages - 1
    assert got[last].receive is None                       # the loss rank makes it
    for r in range(last):                                  # each rank: its last gradients, from downstream
        assert got[r].receive == RecvGradients(3, r + 1, r)
        assert got[r + 1].sends == frozenset({SendGradients(3, r, r + 1)})
    assert got[0].sends == frozenset()


@pytest.mark.parametrize("replicas, schedule", [
    ([1, 2], "1f1b"), ([1, 2], "gpipe"), ([2], "1f1b"),    # a replicated last stage: several loss ranks
    ([2, 1], "1f1b"), ([2, 1, 1, 1], "gpipe"),             # a replica's last gradient leaves before the last loss
    ([1, 1], "pipedream"), ([1, 1, 1, 1], "pipedream"),   # updates that do not wait for the step's losses
])
def test_what_cannot_be_proven_keeps_the_collectives(replicas, schedule):
    assert routes(replicas, schedule) is None


def test_a_replica_whose_last_gradient_follows_every_loss_is_proven():
    got = routes([2, 1], "gpipe")           # gpipe: the loss rank runs every loss before any backward
    assert got is not None
    assert got[2].sends == frozenset({SendGradients(2, 0, 1), SendGradients(3, 1, 1)})


def virtual(p: int, v: int, schedule: str) -> dict[int, NewsRoute] | None:
    kind = get_schedule(schedule)
    topo = Topology(tuple((kind.group_of(s, p),) for s in range(p * v)), 4)
    return news_routes(all_programs(topo, kind, drain=False))


def test_virtual_stages_are_checked_not_assumed():
    assert virtual(2, 2, "interleaved-1f1b") is not None
    assert virtual(4, 2, "interleaved-1f1b") is not None
    assert virtual(2, 2, "zbv") is not None
    assert virtual(4, 2, "zbv") is None         # rank 3's last gradients leave rank 0 before its last loss


def chain_lists(send_after_loss: bool) -> dict:
    """Two ranks, two micro-batches, written by hand: rank 1's last gradients leave before or after
    its last loss."""
    tail = [Loss(1, 1), Backward(1, 1), SendGradients(1, 0, 1)]
    if not send_after_loss:
        tail = [Backward(1, 1), SendGradients(1, 0, 1), Loss(1, 1)]
    one = [RecvActivations(0, 0, 1), Forward(0, 1), LoadTarget(0, 1), Loss(0, 1), Backward(0, 1),
           SendGradients(0, 0, 1), RecvActivations(1, 0, 1), Forward(1, 1), LoadTarget(1, 1), *tail, Step(0.5)]
    zero = [Forward(0, 0), SendActivations(0, 1, 0), Forward(1, 0), SendActivations(1, 1, 0),
            RecvGradients(0, 1, 0), Backward(0, 0), RecvGradients(1, 1, 0), Backward(1, 0), Step(0.5)]
    return {0: zero, 1: one}


def test_the_check_follows_the_lists_order():
    assert news_routes(chain_lists(True)) is not None
    assert news_routes(chain_lists(False)) is None
    late = chain_lists(True)
    late[0] = [*late[0][:-3], Step(0.5), late[0][-3], late[0][-2]]       # the update before the carrier
    assert news_routes(late) is None


class Notes:
    """A StepNews that keeps what each rank made, received and when it updated."""

    def __init__(self, route: NewsRoute, rank: int, log: list) -> None:
        self.route, self.rank, self.log = route, rank, log
        self.note: dict[int, torch.Tensor] = {}

    def outgoing(self, step: int, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        if step not in self.note:
            assert self.route.receive is None, "forwarded before received"
            total = torch.stack([v.detach().double() for v in losses.values()]).sum()
            self.note[step] = torch.stack([torch.zeros((), dtype=torch.float64), total,
                                           torch.tensor(float(len(losses)), dtype=torch.float64)])
            self.log.append(("made", self.rank, step, self.note[step].clone()))
        return self.note[step]

    def incoming(self, step: int, note: torch.Tensor) -> None:
        self.note[step] = note
        self.log.append(("in", self.rank, step, note.clone()))


def news_engine(log: list):
    class Engine(PipelineEngine):
        def __init__(self, stages, topo, rank, schedule, **kwargs):
            route = news_routes(all_programs(topo, schedule, drain=False))
            assert route is not None
            super().__init__(stages, topo, rank, schedule, news=Notes(route[rank], rank, log), **kwargs)
            self._steps = 0

        def _execute_step_level(self, ins, result) -> None:
            if isinstance(ins, Step):
                log.append(("step", self.rank, self._steps, None))
                self._steps += 1
            super()._execute_step_level(ins, result)
    return Engine


@pytest.mark.parametrize("schedule, cuts, replicas, virtual_stages", [
    ("1f1b", [1, 3, 5], [1, 1, 1, 1], 1), ("gpipe", [3], [2, 1], 1), ("zb-h1", [3], [1, 1], 1),
    ("interleaved-1f1b", [1, 3, 5], [1, 1], 2),
    pytest.param("zbv", [1, 3, 5], [1, 1], 2, marks=pytest.mark.slow)])     # ~1 s: tests/SUITE.md
def test_every_rank_holds_the_loss_ranks_note_before_its_update(schedule, cuts, replicas, virtual_stages):
    plan = make_plan("mlp", cuts, replicas, schedule=schedule, micro_batches=4, batch_size=4,
                     virtual_stages=virtual_stages)
    log: list = []
    steps = 2
    weights, losses = train_pipeline(plan, steps, engine_class=news_engine(log))
    plain_weights, plain_losses = train_pipeline(plan, steps)
    assert losses == plain_losses and all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    source = plan.stages[-1].ranks[0]
    made = {step: note for kind, _, step, note in log if kind == "made"}
    assert sorted(made) == list(range(steps))
    for step in range(steps):
        expected = sum(losses[step]) / len(losses[step])
        assert float(made[step][1] / made[step][2]) == pytest.approx(expected, rel=1e-6)
    for rank in range(plan.world_size):
        mine = [(kind, step, note) for kind, r, step, note in log if r == rank]
        order = [(kind, step) for kind, step, _ in mine if kind != "made"]
        if rank == source:
            assert order == [("step", k) for k in range(steps)]
            continue
        assert order == [x for k in range(steps) for x in (("in", k), ("step", k))], (rank, order)
        assert all(torch.equal(note, made[step]) for kind, step, note in mine if kind == "in")


def test_the_engine_finds_its_carriers_by_identity():
    topo, kind = topology([1, 1, 1]), get_schedule("1f1b")
    programs = all_programs(topo, kind, drain=False)
    got = news_routes(programs)
    assert got is not None
    swapped = carried_by(programs[1], got[1])
    assert swapped == programs[1]
    assert [i for i in swapped if i is got[1].receive or any(i is s for s in got[1].sends)] == \
        [got[1].receive, *got[1].sends]
