"""What a split schedule (zb-h1) holds between a micro-batch's input half (B) and weight half (W):
``Schedule.whole`` against a count over the schedule's own op order, and ``stagememory.memory_bytes``
/ ``evaluate`` charging ``ModelCosts.half_bytes`` (not the whole stash) for those micro-batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.schedule_registry import Op, get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.stagememory import memory_bytes
from tests.partitioner.synth import flat_cluster


def peak_by_ops(ops: list[Op], split: bool, stash: float, half: float) -> float:
    """The most bytes held after any op: a forwarded micro-batch weighs ``stash`` until its B, then
    (a split schedule) ``half`` until its W."""
    whole = halves = 0
    peak = 0.0
    for op, _ in ops:
        if op == "F":
            whole += 1
        elif op == "B":
            whole -= 1
            halves += 1 if split else 0
        else:
            halves -= 1
        peak = max(peak, whole * stash + halves * half)
    return peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_whole_and_half_micro_batches_match_the_op_order(name):
    """For every micro-batch count and depth, as the engine runs the schedule (warm = depth forwards
    ahead, defer = depth_all - depth weight halves held back: ``pipeline.schedules.Topology``), a
    half lighter or heavier than a whole (the recorded gradients: a big vocabulary's logits')."""
    kind = get_schedule(name)
    assert kind.replica_ops is not None
    for k in range(1, 10):
        for depth in range(1, 6):
            for depth_all in range(depth, 8):
                ops = list(kind.replica_ops(range(k), depth, depth_all - depth))
                inflight, whole = kind.inflight(k, depth, depth_all), kind.whole(k, depth, depth_all)
                halves = kind.most_halves(k, depth, depth_all)
                for half in (0.0, 3.0, 10.0, 15.0, 40.0):
                    expected = peak_by_ops(ops, kind.split_backward, 10.0, half)
                    assert kind.held_bytes(inflight, whole, halves, 10.0, half) == expected, (k, depth, depth_all, half)
                    if half <= 10.0:
                        assert whole * 10.0 + (inflight - whole) * half == expected
                if not kind.split_backward:
                    assert whole == inflight
                vec = kind.whole(np.array([k]), np.array([depth]), np.array([depth_all]))
                assert vec.tolist() == [whole]
                most = kind.most_halves(np.array([k]), np.array([depth]), np.array([depth_all]))
                assert np.asarray(most).tolist() == [halves]


def _costs(stash: float, half: float) -> ModelCosts:
    """Two nodes of 100 weight bytes each; every stage holds ``stash`` per micro-batch, ``half``
    between its B and W, keeps 7 when recomputing and reruns 30."""
    n = 2
    zeros = np.zeros(n)
    upper = np.triu(np.ones((n, n)))
    return ModelCosts(names=("a", "b"), params=(("a.w",), ("b.w",)), forward_ms=np.ones(n), backward_ms=np.ones(n),
                      param_bytes=np.full(n, 100.0), activation_bytes=zeros, cut_bytes=np.array([5.0, 0.0]),
                      cut_grad_bytes=np.array([5.0, 0.0]), stash=stash * upper, kept=7.0 * upper,
                      rerun=30.0 * upper, half=half * upper)


def test_memory_bytes_charges_the_weight_half_between_b_and_w():
    costs = _costs(stash=1000.0, half=200.0)
    zb, one = Options(get_schedule("zb-h1"), 4), Options(get_schedule("1f1b"), 4)
    static = 100.0 * (2 + OPTIMIZER_STATES["sgd"])
    # the last of 2 stages: 1F1B's one forward ahead, one weight half held back
    assert memory_bytes(costs, 1, 1, 2, zb, split=(1, 2)) == static + 1000.0 + 200.0
    assert memory_bytes(costs, 1, 1, 2, zb) == static + 2 * 1000.0         # split=None: every one whole
    assert memory_bytes(costs, 1, 1, 2, zb, recompute=True, split=(1, 2)) == static + 2 * 7.0 + 30.0
    assert memory_bytes(costs, 1, 1, 1, one, split=(1, 0)) == static + 1000.0
    # a half heavier than a whole (the recorded gradients): the peak right after the second B
    upper = np.triu(np.ones((2, 2)))
    heavy = dataclasses.replace(costs, half=1500.0 * upper, recorded=800.0 * upper)
    assert memory_bytes(heavy, 1, 1, 2, zb, split=(1, 2)) == static + 2 * 1500.0
    assert memory_bytes(heavy, 1, 1, 2, zb, recompute=True, split=(1, 2)) == static + 2 * (7.0 + 800.0) + 30.0


def test_evaluate_predicts_half_bytes_for_held_back_weight_halves_only():
    """Two stages of one worker each, 4 micro-batches: stage 0 holds 2 whole (1F1B's depth there is
    the pipeline's), stage 1 one whole and one between B and W; 1f1b holds no half anywhere."""
    costs = _costs(stash=1000.0, half=200.0)
    stages = [StageSpec(0, 0, (0,)), StageSpec(1, 1, (1,))]
    model = CostModel(flat_cluster(2))
    static = 100.0 * (2 + OPTIMIZER_STATES["sgd"])
    zb = evaluate(costs, model, stages, Options(get_schedule("zb-h1"), 4))
    assert [e.memory_bytes for e in zb.stages] == [static + 2000.0, static + 1200.0]
    one = evaluate(costs, model, stages, Options(get_schedule("1f1b"), 4))
    assert [e.memory_bytes for e in one.stages] == [static + 2000.0, static + 1000.0]
    same = evaluate(dataclasses.replace(costs, half=None), model, stages, Options(get_schedule("zb-h1"), 4))
    assert [e.memory_bytes for e in same.stages] == [static + 2000.0, static + 2000.0]     # not measured: as before
