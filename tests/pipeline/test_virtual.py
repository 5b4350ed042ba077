"""Virtual stages: a rank that holds several model chunks (interleaved 1F1B, zbv's V) trains exactly as
single-process training of the unsplit model, through the one engine.

The reference is plain SGD on each step's concatenated global batch (harness.train_reference);
replicas sum their gradients through a real in-process all-reduce, tied weights (GPT-2's wte =
lm_head; the zoo's gpt has an untied head) through another; a tie between two chunks of one rank
(zbv puts the first and the last stage on rank group 0) is one parameter there, summed once.
"""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.chunks import rank_module
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessNetwork, run_ranks
from hybridpipe.pipeline.instructions import (
    Backward,
    Forward,
    Instruction,
    LoadInput,
    LoadTarget,
    Loss,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
    SyncStart,
    SyncWait,
)
from hybridpipe.pipeline.plancheck import build_stages
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import (
    capture,
    data_for,
    make_optimizer,
    make_plan,
    max_diff,
    model_loss,
    train_pipeline,
    train_reference,
)
from tests.pipeline.hf_models import GPT2

GPT = "gpt[layers=2,width=32,heads=2,seq=8,vocab=64]"
STEPS = 5
TOL = 1e-5

# model, granularity, batch size, micro-batches, cuts for (p=2, V=2), for (p=2, V=3 or 4)
MODELS = {
    "mlp": ("mlp", "blocks", 4, 4, [1, 3, 5], [0, 1, 2, 3, 4, 5, 6]),
    "resnet-small": ("resnet-small[norm=none]", "modules", 2, 4, [3, 7, 11], [2, 4, 6, 8, 10]),
    "gpt": (GPT, "modules", 2, 4, [3, 8, 13], [2, 5, 8, 11, 14]),
    # GPT-2's embedding (block 0, wte) is its head's weight (block 6, lm_head): a tied weight
    "gpt2-tied": (GPT2, "blocks", 2, 4, [0, 3, 4], [0, 1, 2, 3, 4]),
}


def virtual_plan(case: str, schedule: str, many: bool = False, replicas: tuple[int, int] = (1, 1),
                 recompute: bool = False):
    model, granularity, batch, M, cuts2, cuts_many = MODELS[case]
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    cuts = cuts_many if many else cuts2
    return make_plan(model, cuts, list(replicas), schedule=schedule, micro_batches=M, batch_size=batch,
                     granularity=granularity, virtual_stages=(len(cuts) + 1) // 2, shared_capture=True,
                     recompute=recompute)


def equivalence(plan) -> float:
    ours, losses = train_pipeline(plan, STEPS, shared_capture=True)
    assert len(losses) == STEPS and all(len(v) == plan.micro_batches for v in losses.values())
    return max_diff(ours, train_reference(plan, STEPS))


@pytest.mark.parametrize("case", list(MODELS))
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_two_chunks_per_rank_equal_single_process_sgd(case, schedule):
    assert equivalence(virtual_plan(case, schedule)) <= TOL


@pytest.mark.parametrize("case", list(MODELS))
def test_interleaved_with_more_chunks_equals_single_process_sgd(case):
    plan = virtual_plan(case, "interleaved-1f1b", many=True)
    assert plan.virtual_stages >= 3
    assert equivalence(plan) <= TOL


@pytest.mark.parametrize("case", list(MODELS))
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_replicated_chunks_equal_single_process_sgd(case, schedule):
    assert equivalence(virtual_plan(case, schedule, replicas=(2, 1))) <= TOL


@pytest.mark.parametrize("case", list(MODELS))
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_recomputing_chunks_equal_single_process_sgd(case, schedule):
    assert equivalence(virtual_plan(case, schedule, replicas=(1, 2), recompute=True)) <= TOL


def test_zbv_ties_gpt2_weights_inside_rank_group_zero():
    """zbv puts GPT-2's embedding (stage 0) and head (stage 3) on group 0: one parameter there."""
    plan = virtual_plan("gpt2-tied", "zbv", replicas=(2, 1))
    (tie,) = plan.tied
    assert plan.stages[tie.stages[0]].ranks == plan.stages[tie.stages[-1]].ranks == (0, 1)
    assert equivalence(plan) <= TOL


def test_the_comparison_can_fail():
    """Without the tied-weight sum GPT-2 drifts from the reference: the test can fail."""
    plan = virtual_plan("gpt2-tied", "interleaved-1f1b")
    assert plan.tied
    ours, _ = train_pipeline(plan, STEPS, shared_capture=True, tied_sync=False)
    ours = {k: v for k, v in ours.items()}
    ref = train_reference(plan, STEPS)
    assert max(float((ours[k] - ref[k]).abs().max()) for k in ours if k in ref) > 10 * TOL


# ---- the engine on hand-written lists ----------------------------------------------------------
def chunked_gpipe(topo: Topology, rank: int) -> list[Instruction]:
    """All forwards of the rank's chunks in model order, then all backwards in reverse, one step;
    each chunk's last backward starts its replicas' sync, all waited for before the step: written
    out by hand here (not by schedules.py) to test the engine alone."""
    M, last = topo.micro_batches, topo.n_stages - 1
    replica, mine = topo.replica_of(rank), topo.stages_of(rank)
    r = topo.replicas(mine[0])
    micro = [m for m in range(M) if m % r == replica]
    out: list[Instruction] = []
    for s in mine:
        for m in micro:
            out.append(LoadInput(m, s) if s == 0 else RecvActivations(m, topo.rank_for(s - 1, m), s))
            out.append(Forward(m, s))
            out += [LoadTarget(m, s), Loss(m, s)] if s == last else [SendActivations(m, topo.rank_for(s + 1, m), s)]
    for s in reversed(mine):
        for m in micro:
            if s != last:
                out.append(RecvGradients(m, topo.rank_for(s + 1, m), s))
            if r > 1 and m == micro[-1]:
                out.append(SyncStart(m, s))
            out.append(Backward(m, s))
            if s != 0:
                out.append(SendGradients(m, topo.rank_for(s - 1, m), s))
    return out + [SyncWait(s) for s in mine if r > 1] + [Step(1.0 / M)]


class HandWritten(PipelineEngine):
    def program(self, drain: bool = False) -> list[Instruction]:
        return chunked_gpipe(self.topo, self.rank)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("replicas", [(1, 1), (2, 1)])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("case", list(MODELS))
def test_engine_on_hand_written_lists_equals_single_process_sgd(case, schedule, replicas, recompute):
    """The engine alone (lists written above, not by schedules.py): chunks, replicas' per-chunk
    syncs, recomputation, GPT's tie (across ranks, or inside rank group 0 under zbv's layout)."""
    plan = virtual_plan(case, schedule, replicas=replicas, recompute=recompute)
    ours, _ = train_pipeline(plan, STEPS, shared_capture=True, engine_class=HandWritten)
    assert max_diff(ours, train_reference(plan, STEPS)) <= TOL


def test_rank_module_holds_every_chunk_once():
    plan = virtual_plan("gpt2-tied", "zbv")
    spec = resolve_model(plan.model)
    captured = capture(spec, plan.batch_size, granularity=plan.granularity)
    stages = build_stages(captured, plan, 0, loss=spec.loss)
    module = rank_module([st.module for st in stages])
    union = {k for st in stages for k in st.module.state_dict()}
    assert set(module.state_dict()) == union
    params = list(module.parameters())
    assert len({id(p) for p in params}) == len(params)
    second = {id(p) for p in stages[1].module.parameters()}
    shared = [n for n, p in stages[0].module.named_parameters() if id(p) in second]
    assert shared, "zbv's group 0 should share GPT's tied embedding between its two chunks"
    assert len(params) == len({id(p) for st in stages for p in st.module.parameters()})


def test_engine_refuses_the_wrong_chunks_and_pipedream():
    plan = virtual_plan("mlp", "interleaved-1f1b")
    spec = resolve_model(plan.model)
    stages = build_stages(capture(spec, plan.batch_size), plan, 0, loss=spec.loss)
    opt = torch.optim.SGD(rank_module([st.module for st in stages]).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rank 0 runs stage 0,2 of the plan, but the engine got stage 0"):
        PipelineEngine(stages[:1], Topology.from_plan(plan), 0, plan.kind, transport=None, optimizer=opt,
                       data=None)
    with pytest.raises(UserError):
        PipelineEngine(stages, Topology.from_plan(plan), 0, get_schedule("pipedream"), transport=None, optimizer=opt,
                       data=None)


@pytest.mark.parametrize("case,schedule", [("mlp", "zbv"), ("gpt2-tied", "interleaved-1f1b")])
def test_evaluation_on_chunks_equals_the_unsplit_model(case, schedule):
    """run_eval on a rank with several chunks: each micro-batch's loss as the unsplit model gives it."""
    plan = virtual_plan(case, schedule, replicas=(1, 2))
    spec = resolve_model(plan.model)
    topo = Topology.from_plan(plan)
    network = InProcessNetwork(timeout=30)
    data = data_for(plan, 1)

    def rank_fn(rank):
        stages = build_stages(capture(spec, plan.batch_size, granularity=plan.granularity), plan, rank, loss=spec.loss)
        module = rank_module([st.module for st in stages])
        engine = PipelineEngine(stages, topo, rank, get_schedule(schedule), transport=network.transport(rank),
                                optimizer=make_optimizer(module.parameters(), 0.1), data=data)
        return lambda: engine.run_eval(data)

    results = run_ranks({r: rank_fn(r) for r in range(plan.world_size)}, network)
    assert not network.pending()
    losses = {m: float(v) for res in results.values() for m, v in res.items()}
    torch.manual_seed(0)
    model = spec.build().eval()
    with torch.no_grad():
        expected = {m: float(model_loss(spec, model, *data.batch(0, m))) for m in range(plan.micro_batches)}
    assert losses.keys() == expected.keys()
    assert max(abs(losses[m] - expected[m]) for m in expected) <= 1e-5

