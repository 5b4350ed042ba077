"""schedules.eval_program: the forward-only list of an evaluation step."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.instructions import (
    Forward,
    LoadInput,
    LoadTarget,
    Loss,
    RecvActivations,
    SendActivations,
    message_key,
)
from hybridpipe.pipeline.schedules import Topology, eval_program, rank_program


def topology(replicas: list[int], M: int) -> Topology:
    ranks, r = [], 0
    for n in replicas:
        ranks.append(tuple(range(r, r + n)))
        r += n
    return Topology(tuple(ranks), M)


@settings(max_examples=100, deadline=None)
@given(replicas=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=6), extra=st.integers(0, 6))
def test_eval_lists_forward_each_micro_batch_once_per_stage_and_every_send_meets_its_receive(replicas, extra):
    M = max(replicas) + extra
    topo = topology(replicas, M)
    sends, recvs = Counter(), Counter()
    for ranks in topo.stage_ranks:
        forwarded = []
        for j, r in enumerate(ranks):
            prog = eval_program(topo, r)
            allowed = (LoadInput, RecvActivations, Forward, SendActivations, LoadTarget, Loss)
            assert all(isinstance(ins, allowed) for ins in prog)        # no backward, sync or step
            mine = [ins.micro_batch for ins in prog if isinstance(ins, Forward)]
            assert mine == [m for m in range(M) if m % len(ranks) == j]
            forwarded += mine
            for ins in prog:
                if isinstance(ins, SendActivations):
                    sends[(r, ins.peer, message_key(ins, ins.micro_batch, M))] += 1
                elif isinstance(ins, RecvActivations):
                    recvs[(ins.peer, r, message_key(ins, ins.micro_batch, M))] += 1
            # the same routing as training: the forward half of the training list, in micro-batch order
            train = [ins for ins in rank_program(topo, r, get_schedule("gpipe")) if isinstance(ins, allowed)]
            assert prog == train
        assert sorted(forwarded) == list(range(M))
    assert sends == recvs
