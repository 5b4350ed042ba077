"""The engine against plain single-process training (threads + the in-process transport).

gpipe and 1f1b must give the update of one SGD step on the step's concatenated micro-batches;
replicas sum their gradients through a real in-process all-reduce (ReplicaGroup).
"""

from __future__ import annotations

import pytest
import torch

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessNetwork, run_ranks
from hybridpipe.pipeline.plancheck import build_stage
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import (
    capture,
    data_for,
    make_optimizer,
    make_plan,
    max_diff,
    train_pipeline,
    train_reference,
)

GPT = "gpt[layers=2,width=32,heads=2,seq=8,vocab=64]"
STEPS = 5
TOL = 1e-5

CASES = {
    # model, cut after these node ids, replicas per stage, micro-batches, batch size, granularity
    "mlp": ("mlp", [2, 5], [1, 2, 1], 4, 4, "blocks"),
    "mlp-4-stages": ("mlp", [1, 3, 5], [2, 1, 3, 1], 6, 3, "blocks"),
    "alexnet-small": ("alexnet-small[dropout=0]", [6, 14], [2, 1, 1], 4, 2, "blocks"),
    "resnet-small": ("resnet-small[norm=none]", [3, 7, 13], [1, 2, 1, 1], 4, 2, "modules"),  # skips cross every cut
    "gpt": (GPT, [3, 11], [1, 2, 1], 4, 2, "modules"),                                      # cuts inside attention
}


def equivalence(case: str, schedule: str, optimizer: str = "sgd") -> float:
    model, cuts, reps, M, B, granularity = CASES[case]
    plan = make_plan(model, cuts, reps, schedule=schedule, micro_batches=M, batch_size=B, granularity=granularity)
    lr = 0.01 if optimizer == "adam" else 0.05
    ours, losses = train_pipeline(plan, STEPS, lr=lr, optimizer=optimizer)
    assert len(losses) == STEPS and all(len(v) == M for v in losses.values())
    return max_diff(ours, train_reference(plan, STEPS, lr=lr, optimizer=optimizer))


@pytest.mark.parametrize("case", ["mlp", "mlp-4-stages", "gpt", "resnet-small", "alexnet-small"])
def test_1f1b_equals_single_process_sgd(case):
    assert equivalence(case, "1f1b") <= TOL


@pytest.mark.parametrize("case", ["mlp", "mlp-4-stages", "gpt", "resnet-small", "alexnet-small"])
def test_gpipe_equals_single_process_sgd(case):
    assert equivalence(case, "gpipe") <= TOL


def test_1f1b_with_adam_equals_single_process():
    assert equivalence("mlp", "1f1b", optimizer="adam") <= TOL


def test_the_comparison_can_fail():
    """A pipeline that skips the gradient all-reduce (each replica keeps its own sum) must differ."""
    model, cuts, reps, M, B, _ = CASES["mlp"]
    plan = make_plan(model, cuts, reps, schedule="1f1b", micro_batches=M, batch_size=B)
    spec = resolve_model(model)
    topo = Topology.from_plan(plan)
    network = InProcessNetwork(timeout=30)

    def rank_fn(rank):
        stage = build_stage(capture(spec, plan.batch_size), plan, rank, loss=spec.loss)
        engine = PipelineEngine(stage, topo, rank, get_schedule("1f1b"), transport=network.transport(rank),
                                optimizer=make_optimizer(stage.module.parameters(), 0.05), data=data_for(plan, 2))
        return lambda: [engine.run_step(k) for k in range(2)] and stage.state_dict()

    states = run_ranks({r: rank_fn(r) for r in range(plan.world_size)}, network)
    merged = {**states[0], **states[1], **states[3]}
    assert max_diff(merged, train_reference(plan, 2)) > 10 * TOL


def test_recorder_sees_every_phase_in_order():
    plan = make_plan("mlp", [2], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    spec = resolve_model("mlp")
    network = InProcessNetwork(timeout=30)
    records: dict[int, list] = {0: [], 1: []}

    class Recorder:
        def __init__(self, rank):
            self.rank = rank

        def record(self, phase, micro_batch, t0, t1, stage=None):
            assert t1 >= t0
            records[self.rank].append((phase, micro_batch))

    def rank_fn(rank):
        stage = build_stage(capture(spec, plan.batch_size), plan, rank, loss=spec.loss)
        engine = PipelineEngine(stage, Topology.from_plan(plan), rank, plan.kind, transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1),
                                data=data_for(plan, 2), recorder=Recorder(rank))
        return lambda: engine.run_step(1)

    results = run_ranks({0: rank_fn(0), 1: rank_fn(1)}, network)
    assert sorted(results[1].losses) == [0, 1] and results[0].losses == {}
    phases0 = [p for p, _ in records[0]]
    assert phases0 == ["receive_for", "run_for", "send_for"] * 2 + ["receive_back", "run_back"] * 2 + ["step"]
    assert {m for _, m in records[1] if m >= 0} == {2, 3}              # step 1's micro-batches, numbered in the run
    assert "send_back" in [p for p, _ in records[1]]


def test_a_dead_peer_stops_the_pipeline_with_a_clear_error():
    plan = make_plan("mlp", [2], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    spec = resolve_model("mlp")
    network = InProcessNetwork(timeout=30)

    def rank_fn(rank):
        stage = build_stage(capture(spec, plan.batch_size), plan, rank, loss=spec.loss)
        engine = PipelineEngine(stage, Topology.from_plan(plan), rank, plan.kind, transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1), data=data_for(plan, 1))
        if rank == 0:
            def crash():
                raise RuntimeError("stage 0 ran out of memory")
            return crash
        return lambda: engine.run_step(0)

    with pytest.raises(RuntimeError, match="out of memory"):
        run_ranks({0: rank_fn(0), 1: rank_fn(1)}, network)


def test_engine_refuses_a_stage_of_another_rank():
    plan = make_plan("mlp", [2], [1, 1])
    spec = resolve_model("mlp")
    stage = build_stage(capture(spec, plan.batch_size), plan, 0, loss=spec.loss)
    with pytest.raises(ValueError, match="rank 1 runs stage 1"):
        PipelineEngine(stage, Topology.from_plan(plan), 1, get_schedule("1f1b"), transport=None,
                       optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1), data=None)


def test_without_a_recorder_the_engine_reads_no_clock():
    """The clock is read around each instruction for a recorder only (overhead: two calls per instruction)."""
    plan = make_plan("mlp", [2], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    spec = resolve_model("mlp")
    network = InProcessNetwork(timeout=30)
    reads = {0: 0, 1: 0}
    recorded = {0: 0, 1: 0}

    class Recorder:
        def __init__(self, rank):
            self.rank = rank

        def record(self, phase, micro_batch, t0, t1, stage=None):
            recorded[self.rank] += 1

    def rank_fn(rank):
        def clock():
            reads[rank] += 1
            return float(reads[rank])
        stage = build_stage(capture(spec, plan.batch_size), plan, rank, loss=spec.loss)
        engine = PipelineEngine(stage, Topology.from_plan(plan), rank, plan.kind, transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1),
                                data=data_for(plan, 2), clock=clock)
        engines[rank] = engine

        def run():
            engine.run_step(0)
            after_step0[rank] = reads[rank]
            engine.run_step(1, recorder=Recorder(rank))
        return run

    engines: dict[int, PipelineEngine] = {}
    after_step0 = {0: -1, 1: -1}
    run_ranks({0: rank_fn(0), 1: rank_fn(1)}, network)
    for rank in (0, 1):     # step 0, no recorder: none; step 1: one per instruction, one more per record
        assert after_step0[rank] == 0
        assert recorded[rank] > 0
        assert reads[rank] == len(engines[rank].program()) + recorded[rank]
