"""Shared helpers for the pipeline tests: hand-made plans, threaded pipelines, references."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset

from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.plan import Plan, Stage, TiedGroup
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.tied import shared_across
from hybridpipe.pipeline.chunks import rank_module
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessGradSync, InProcessNetwork, ReplicaGroup, run_ranks
from hybridpipe.pipeline.plancheck import build_stages
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.stage import PipelineStage, captured_signature
from hybridpipe.pipeline.tied import TiedSync, complete_tied, stage_tied_params, tied_ranks
from hybridpipe.pipeline.tokens import TokenCounts
from hybridpipe.profiles.capture import CapturedModel, call_args, capture_model, tied_parameters, training_switches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.graphinfo import node_infos
from hybridpipe.profiles.losses import label_counter
from hybridpipe.profiles.zoo import ModelSpec, resolve_model
from hybridpipe.runtime.parts import NoParameters
from hybridpipe.runtime.scaler import LossScaler

Observer = Callable[[int, int, PipelineStage], None]     # (rank, step, stage) after every step


def fresh_capture(spec: ModelSpec, batch_size: int = 4, seed: int = 0, granularity: str = "blocks",
                  autocast: torch.dtype | None = None) -> CapturedModel:
    """The spec's model built from ``seed`` and captured as every rank does it (under autocast to
    ``autocast``, if given)."""
    torch.manual_seed(seed)
    module = spec.build()
    example = spec.example_input(batch_size, torch.Generator().manual_seed(seed))
    return capture_model(module, example, granularity=granularity, leaf_modules=spec.leaf_modules, autocast=autocast)


_CAPTURES: dict[tuple, tuple[CapturedModel, torch.Tensor]] = {}


def capture(spec: ModelSpec, batch_size: int = 4, seed: int = 0, granularity: str = "blocks",
            autocast: torch.dtype | None = None) -> CapturedModel:
    """What :func:`fresh_capture` returns, as a deep copy of one capture per (model, batch size,
    seed, granularity, autocast) of this test session: a capture takes 0.1-0.5 s of CPU (a Hugging
    Face model's over a second) and the in-process tests take hundreds; a copy takes 10 ms. Every
    copy is the same fresh model, as separate captures on every rank are (tests/runtime runs those),
    and leaves the global RNG where a fresh capture leaves it."""
    key = (spec.name, batch_size, seed, str(granularity), str(autocast))
    if key not in _CAPTURES:
        captured = fresh_capture(spec, batch_size, seed, granularity, autocast)
        _CAPTURES[key] = captured, torch.get_rng_state()
    captured, rng = _CAPTURES[key]
    torch.set_rng_state(rng)
    return copy.deepcopy(captured)


capture_copy = capture      # the older name (tests asked for the shared capture; now every capture is one)


def plan_tied(captured: CapturedModel, ranges: list[tuple[int, int]]) -> tuple[TiedGroup, ...]:
    """The tied groups a partitioner would write for these ranges."""
    infos = node_infos(captured)
    found = shared_across([i.params for i in infos], [i.shared for i in infos], tied_parameters(captured.module),
                          ranges)
    return tuple(TiedGroup(p, stages, 0) for p, stages in found)


def make_plan(model: str, cuts: list[int], replicas: list[int], *, schedule: str = "1f1b", micro_batches: int = 4,
              batch_size: int = 4, times: list[tuple[float, float]] | None = None, send_ms: float = 0.0,
              n_nodes: int | None = None, signature: str = "", granularity: str = "blocks",
              shared_capture: bool = False, virtual_stages: int = 1, recompute: bool = False,
              autocast: torch.dtype | None = None) -> Plan:
    """A plan cutting ``model`` after the node ids in ``cuts`` (stage s ends at cuts[s]); ``n_nodes``
    and ``signature`` default to the captured model's (give others for a plan made for another graph).
    With ``virtual_stages`` V the cuts make p*V stages and ``replicas`` lists the p rank groups'
    replicas; the schedule's layout (schedule_registry) puts each stage on its group.
    ``recompute``: every stage recomputes its activations in the backward. ``autocast``: plan on the
    capture under autocast (the same blocks and signature as float32's). ``shared_capture``: kept for
    older callers (every capture is shared now, see capture)."""
    spec = resolve_model(model)
    captured = capture(spec, batch_size, granularity=granularity, autocast=autocast)
    n_nodes = n_nodes or len(captured.blocks)
    signature = signature or captured_signature(captured)
    bounds = [-1, *cuts, n_nodes - 1]
    p = len(replicas)
    group_ranks = [tuple(range(sum(replicas[:i]), sum(replicas[:i + 1]))) for i in range(p)]
    kind = get_schedule(schedule)
    stages = []
    for s in range(len(bounds) - 1):
        ranks = group_ranks[kind.group_of(s, p)]
        f, b = times[s] if times else (0.0, 0.0)
        stages.append(Stage(index=s, first_node=bounds[s] + 1, last_node=bounds[s + 1], replicas=len(ranks),
                            ranks=ranks, compute_ms=f + b, forward_ms=f, backward_ms=b,
                            send_ms=send_ms if s < len(bounds) - 2 else 0.0, recompute=recompute))
    assert len(stages) == p * virtual_stages, f"{len(cuts)} cuts make {len(stages)} stages, not {p} x {virtual_stages}"
    rank = sum(replicas)
    cluster = Cluster((Level("node", rank, 100.0),), 16.0)
    ranges = [(s.first_node, s.last_node) for s in stages]
    return Plan(model=model, batch_size=batch_size, input_shape=(batch_size, *spec.sample_shape),
                profile_signature=signature, cluster=cluster, strategy="uniform", schedule=schedule,
                micro_batches=micro_batches, optimizer="sgd", stages=tuple(stages), tied=plan_tied(captured, ranges),
                granularity=granularity, virtual_stages=virtual_stages, graph_nodes=n_nodes)


def data_for(plan: Plan, steps: int, seed: int = 1, dataset: Dataset | None = None) -> MicroBatches:
    """The plan's micro-batches: synthetic data, or ``dataset``'s samples."""
    spec = resolve_model(plan.model)
    size = steps * plan.micro_batches * plan.batch_size
    if dataset is None:
        dataset = resolve_dataset("synthetic", spec, size=size, seed=seed)
    return MicroBatches(dataset, plan.batch_size, plan.micro_batches, targets=spec.loss is not None)


def make_optimizer(params, lr: float, kind: str = "sgd") -> torch.optim.Optimizer:
    params = list(params)
    if not params:                       # a stage of only parameterless operations
        return NoParameters()            # type: ignore[return-value]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.5)


def train_pipeline(plan: Plan, steps: int, *, lr: float = 0.05, seed: int = 0, optimizer: str = "sgd",
                   drain_every: int | None = None, device: str = "cpu", dataset: Dataset | None = None,
                   shared_capture: bool = False, observe: Observer | None = None, tied_sync: bool = True,
                   step_results: dict | None = None, engine_class: type[PipelineEngine] = PipelineEngine,
                   tokens: bool = False, autocast: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                   loss_scale: float | None = None) -> tuple[dict[str, torch.Tensor], dict[int, list[float]]]:
    """Train ``plan`` with one thread per rank (a rank of a plan with virtual stages runs all its
    chunks); returns the merged state dict (replica 0 of every stage, after checking the replicas
    agree bitwise) and the losses per step.

    ``dataset``: the samples (default: synthetic); ``shared_capture``: kept for older callers (every
    rank gets a copy of one capture now, see capture); ``observe(rank, step, stage)`` runs on every
    rank after every step; ``tied_sync=False`` sums nothing across the copies of tied weights (to see them drift apart);
    ``step_results`` (a dict) receives every rank's list of StepResults; ``observe`` runs once per
    chunk of a rank; ``engine_class``: a PipelineEngine subclass (e.g. with hand-written lists);
    ``tokens``: token-weighted loss (pipeline/tokens.py; the step totals summed over the threads).
    ``autocast``: capture and compute under ``torch.autocast`` to that dtype (as the Trainer's
    ``precision``); ``reduce_dtype``: the replicas sum their gradients in that dtype; ``loss_scale``:
    fp16's dynamic loss scale from that initial scale (runtime/scaler.py, the Trainer's hooks: the
    last stage scales each loss, each rank unscales its gradients, every rank agrees on overflow
    and an overflowing step is skipped everywhere)."""
    spec = resolve_model(plan.model)
    topo = Topology.from_plan(plan)
    network = InProcessNetwork(timeout=60)
    groups = [ReplicaGroup(s.replicas) for s in plan.stages]
    tied_groups = {ranks: ReplicaGroup(len(ranks)) for ranks in {tied_ranks(plan, g) for g in plan.tied}}
    world = ReplicaGroup(plan.world_size)           # the token totals' and the loss scale's all-reduces

    def rank_fn(rank: int):
        captured = capture(spec, plan.batch_size, seed, plan.granularity, autocast)
        stages = [st.to(device) for st in build_stages(captured, plan, rank, loss=spec.loss)]
        module = rank_module([st.module for st in stages])      # every chunk's parameters (virtual stages)
        replica = plan.stages_of_rank(rank)[1]
        held = stage_tied_params(plan, [st.index for st in stages], captured.module)
        tied = TiedSync([(params, _summer(tied_groups[ranks], ranks.index(rank)) if tied_sync else _no_sum)
                         for ranks, params in held.items()])
        syncs = {st.index: InProcessGradSync(st.module, groups[st.index], replica, exclude=tied.params,
                                             wire_dtype=reduce_dtype) for st in stages}
        counts = None
        if tokens:
            def total(part: torch.Tensor) -> torch.Tensor:
                world.all_reduce_sum(rank, [part])
                return part
            counts = TokenCounts(total, count_input=label_counter(captured.module) if spec.loss is None else None)
        engine = engine_class(stages, topo, rank, plan.kind, transport=network.transport(rank),
                              optimizer=make_optimizer(module.parameters(), lr, optimizer),
                              data=data_for(plan, steps, dataset=dataset), sync=syncs, tied=tied if held else None,
                              tokens=counts, autocast=autocast,
                              **_scaling(loss_scale, module, lambda t: world.all_reduce_sum(rank, [t])))

        def run():
            losses = {}
            for k in range(steps):
                last = k == steps - 1 or (drain_every is not None and (k + 1) % drain_every == 0)
                res = engine.run_step(k, drain=last)
                if step_results is not None:
                    step_results.setdefault(rank, []).append(res)
                losses[k] = [float(v) for _, v in sorted(res.losses.items())]
                if observe is not None:
                    for st in stages:
                        observe(rank, k, st)
            return {k: v.cpu() for k, v in module.state_dict().items()}, losses, engine
        return run

    results = run_ranks({r: rank_fn(r) for r in sorted({r for s in plan.stages for r in s.ranks})}, network,
                        [*groups, *tied_groups.values(), world])
    assert not network.pending(), network.pending()
    merged: dict[str, torch.Tensor] = {}
    losses: dict[int, list[float]] = {}
    for s in plan.stages:
        first = results[s.ranks[0]][0]
        for r in s.ranks[1:]:
            other = results[r][0]
            assert all(torch.equal(first[k], other[k]) for k in first), f"replicas of stage {s.index} differ"
        merged.update(first)
    merged = complete_tied(merged, tied_parameters(spec.build())) if tied_sync else merged
    for s in plan.stages[-1:]:
        for r in s.ranks:
            for k, v in results[r][1].items():
                losses.setdefault(k, []).extend(v)
    return merged, losses


def _to(batch: Any, device: str) -> Any:
    """Every tensor in ``batch`` (nested tuples, lists, dicts) on ``device``."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, batch)


def train_reference(plan: Plan, steps: int, *, lr: float = 0.05, seed: int = 0, optimizer: str = "sgd",
                    device: str = "cpu", dataset: Dataset | None = None, accumulate: bool = False,
                    observe: Callable[[int, torch.nn.Module], None] | None = None) -> dict[str, torch.Tensor]:
    """Plain single-process training on each step's concatenated global batch (mean loss), or with
    ``accumulate`` micro-batch by micro-batch, each one's mean loss / M (gradient accumulation: the
    same thing when micro-batches are alike; micro-batches padded to different lengths cannot be
    concatenated, and a token-mean loss weighs their tokens per micro-batch). ``observe(step,
    model)`` runs after every step."""
    spec = resolve_model(plan.model)
    torch.manual_seed(seed)
    model = spec.build().to(device)
    opt = make_optimizer(model.parameters(), lr, optimizer)
    data = data_for(plan, steps, dataset=dataset)
    for k in range(steps):
        opt.zero_grad()
        if accumulate:
            for m in range(plan.micro_batches):
                x, y = _to(data.batch(k, m), device)
                (model_loss(spec, model, x, y) / plan.micro_batches).backward()
        else:
            x, y = _to(data.global_batch(k), device)
            model_loss(spec, model, x, y).backward()
        opt.step()
        if observe is not None:
            observe(k, model)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def model_loss(spec: ModelSpec, model: torch.nn.Module, x, y) -> torch.Tensor:
    """The unsplit model's loss on one batch, as single-process training computes it."""
    args, kwargs = call_args(x)
    out = model(*args, **kwargs, **training_switches(model))
    return spec.loss(out, y) if spec.loss is not None else out.loss


def _scaling(init_scale: float | None, module: torch.nn.Module,
             total: Callable[[torch.Tensor], None]) -> dict[str, Callable]:
    """The engine's ``loss_scale`` and ``before_step`` for fp16 as the Trainer's (a LossScaler whose
    verdict is the sum of every rank's overflow flag); nothing for None."""
    if init_scale is None:
        return {}
    scaler = LossScaler(init_scale)

    def before_step() -> bool:
        bad = torch.zeros(1)
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / scaler.scale)
                    bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float())
        total(bad)
        scaler.update(bool(bad.item() > 0))
        return not bad.item() > 0
    return {"loss_scale": lambda: scaler.scale, "before_step": before_step}


def _no_sum(flat: torch.Tensor) -> None:
    """A tied-gradient sum that sums nothing: each copy keeps its own stage's gradient."""


def _summer(group: ReplicaGroup, index: int):
    def sum_fn(flat: torch.Tensor) -> None:
        group.all_reduce_sum(index, [flat])
    return sum_fn


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
