"""pipedream (asynchronous 1F1B, weight stashing) against an independent reference model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessGradSync, InProcessNetwork, ReplicaGroup, run_ranks
from hybridpipe.pipeline.plancheck import build_stage
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.stash import WeightStash
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
from tests.pipeline.pipedream_reference import train_pipedream_reference

GPT = "gpt[layers=2,width=32,heads=2,seq=8,vocab=64]"
GRANULARITY = {GPT: "modules"}     # 20 nodes: embed, drop, 8 modules per block, ln, head


@pytest.mark.parametrize("model,cuts,replicas,M,drain_every", [
    ("mlp", [2, 5], [1, 1, 1], 3, None),
    ("mlp", [2, 5], [1, 2, 1], 4, None),
    ("mlp", [1, 3, 5], [2, 1, 2, 1], 4, 2),        # drained (and restarted) in the middle
    (GPT, [4, 12], [1, 2, 1], 2, None),            # cuts inside both transformer blocks: the residual crosses
])
def test_pipedream_matches_weight_stashed_async_sgd(model, cuts, replicas, M, drain_every):
    steps = 5
    plan = make_plan(model, cuts, replicas, schedule="pipedream", micro_batches=M, batch_size=2,
                     granularity=GRANULARITY.get(model, "blocks"))
    ours, _ = train_pipeline(plan, steps, drain_every=drain_every)
    drains = {k for k in range(steps) if k == steps - 1 or (drain_every and (k + 1) % drain_every == 0)}
    ref = train_pipedream_reference(plan, data_for(plan, steps), steps, drains, lr=0.05,
                                    make_optimizer=make_optimizer)
    assert max_diff(ours, ref) <= 1e-6
    # and it really is asynchronous: not the synchronous update
    assert max_diff(ours, train_reference(plan, steps)) > 1e-4


def test_stash_differentiates_the_weights_the_forward_used():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    stash = WeightStash(lin)
    x = torch.randn(5, 4)
    w0 = lin.weight.detach().clone()
    y = torch.func.functional_call(lin, dict(stash.forward_params(7, frozen=True)), (x,))
    with torch.no_grad():
        lin.weight.add_(1.0)                  # an optimizer step between forward and backward
    stash.stepped()
    (y ** 2).sum().backward()
    expected = (2 * (x @ w0.T + lin.bias.detach())).T @ x
    torch.testing.assert_close(lin.weight.grad, expected)     # gradient at w0, landed on the live weight
    assert stash.versions_kept() == 1
    stash.backward_done(7)
    assert stash.versions_kept() == 0


def test_versions_kept_never_exceed_micro_batches_in_flight():
    plan = make_plan("mlp", [2, 5], [1, 2, 1], schedule="pipedream", micro_batches=4, batch_size=2)
    spec = resolve_model("mlp")
    topo = Topology.from_plan(plan)
    network = InProcessNetwork(timeout=30)
    groups = [ReplicaGroup(s.replicas) for s in plan.stages]
    seen: dict[int, list[tuple[int, int]]] = {}

    def rank_fn(rank):
        torch.manual_seed(0)
        stage = build_stage(capture(spec, plan.batch_size, granularity=plan.granularity), plan, rank, loss=spec.loss)
        st, replica = plan.stage_of_rank(rank)
        engine = PipelineEngine(stage, topo, rank, get_schedule("pipedream"), transport=network.transport(rank),
                                optimizer=make_optimizer(stage.module.parameters(), 0.05), data=data_for(plan, 4),
                                sync=InProcessGradSync(stage.module, groups[st.index], replica))

        class Probe:
            def record(self, phase, micro_batch, t0, t1, stage=None):
                seen.setdefault(rank, []).append((engine.stash.versions_kept(), len(engine.in_flight)))

        def run():
            for k in range(4):
                engine.run_step(k, drain=k == 3, recorder=Probe())
                if k < 3 and rank == 0:
                    assert engine.in_flight, "pipedream keeps micro-batches in flight between steps"
            assert engine.in_flight == [] and engine.stash.versions_kept() == 0
            state = engine.state_dict()
            assert state["stash"]["version"] == 4 * plan.micro_batches // st.replicas and not state["in_flight"]
            return state
        return run

    run_ranks({r: rank_fn(r) for r in range(plan.world_size)}, network, groups)
    for pairs in seen.values():
        assert all(kept <= max(flight, 1) for kept, flight in pairs)
    assert max(k for k, _ in seen[0]) >= 2            # stage 0 really keeps several versions


def test_pipedream_steps_must_be_consecutive_while_in_flight():
    plan = make_plan("mlp", [2], [1, 1], schedule="pipedream", micro_batches=2, batch_size=2)
    spec = resolve_model("mlp")
    network = InProcessNetwork(timeout=30)

    def rank_fn(rank):
        stage = build_stage(capture(spec, plan.batch_size, granularity=plan.granularity), plan, rank, loss=spec.loss)
        engine = PipelineEngine(stage, Topology.from_plan(plan), rank, get_schedule("pipedream"),
                                transport=network.transport(rank),
                                optimizer=torch.optim.SGD(stage.module.parameters(), lr=0.1), data=data_for(plan, 9))

        def run():
            engine.run_step(0)
            if rank == 0:
                with pytest.raises(RuntimeError, match="run consecutive steps or drain first"):
                    engine.run_step(5)
            engine.run_step(1, drain=True)
        return run

    run_ranks({0: rank_fn(0), 1: rank_fn(1)}, network)


def _pipedream_ranks(plan, network, groups, steps):
    """Fresh (stage, engine) per rank, as a restarted worker would build them."""
    spec = resolve_model(plan.model)
    topo = Topology.from_plan(plan)
    out = {}
    for s in plan.stages:
        for replica, rank in enumerate(s.ranks):
            torch.manual_seed(0)
            captured = capture(spec, plan.batch_size, granularity=plan.granularity)
            stage = build_stage(captured, plan, rank, loss=spec.loss)
            opt = make_optimizer(stage.module.parameters(), 0.05)
            engine = PipelineEngine(stage, topo, rank, get_schedule("pipedream"), transport=network.transport(rank),
                                    optimizer=opt,
                                    data=data_for(plan, steps),
                                    sync=InProcessGradSync(stage.module, groups[s.index], replica))
            out[rank] = (stage, opt, engine)
    return out


@pytest.mark.parametrize("model,cuts,replicas,M", [
    ("mlp", [1, 3, 5], [1, 2, 1, 1], 2),
    (GPT, [4, 12], [1, 2, 1], 2),
])
def test_pipedream_checkpoint_without_drain_resumes_exactly(model, cuts, replicas, M):
    steps, at = 5, 2
    plan = make_plan(model, cuts, replicas, schedule="pipedream", micro_batches=M, batch_size=2,
                     granularity=GRANULARITY.get(model, "blocks"))
    reference, _ = train_pipeline(plan, steps)
    world = range(plan.world_size)

    # first life: `at` steps, checkpoint with micro-batches in flight, keep going 1 step, die
    network, groups = InProcessNetwork(timeout=30), [ReplicaGroup(s.replicas) for s in plan.stages]
    first = _pipedream_ranks(plan, network, groups, steps)

    def life1(rank):
        stage, opt, engine = first[rank]
        for k in range(at):
            engine.run_step(k)
        saved = copy.deepcopy({"stage": stage.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()})
        engine.run_step(at)                      # training goes on after the checkpoint
        return saved, engine.in_flight

    lives = run_ranks({r: (lambda r=r: life1(r)) for r in world}, network, groups)
    assert any(flight for _, flight in lives.values())
    assert any(s["engine"]["in_flight"] for s, _ in lives.values())

    # second life: fresh everything, restore, run the remaining steps
    network, groups = InProcessNetwork(timeout=30), [ReplicaGroup(s.replicas) for s in plan.stages]
    second = _pipedream_ranks(plan, network, groups, steps)

    def life2(rank):
        stage, opt, engine = second[rank]
        saved = lives[rank][0]
        stage.load_state_dict(saved["stage"])
        opt.load_state_dict(saved["opt"])
        engine.load_state_dict(saved["engine"])
        for k in range(at, steps):
            engine.run_step(k, drain=k == steps - 1)
        return stage.state_dict()

    states = run_ranks({r: (lambda r=r: life2(r)) for r in world}, network, groups)
    assert not network.pending()
    merged = {}
    for s in plan.stages:
        merged.update(states[s.ranks[0]])
    assert max_diff(merged, reference) == 0.0
