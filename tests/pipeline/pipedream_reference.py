"""An independent single-process model of PipeDream's weight-stashed asynchronous SGD.

No engine or schedule code: plain loops over micro-batches with the rule that defines the
schedule. Stage s with r replicas: replica j takes micro-batches base + i*r + j (i = 0, 1, ...
counted from the last (re)start at ``base``); it runs w = ceil(W/r) forwards before its first
backward (W = workers of stage s and all later stages) and then alternates, so the forward of
its i-th micro-batch comes after i - w + 1 of its own updates. Each update averages the
gradients of one micro-batch from every replica (a round). Weight stashing: the forward and
the backward of a micro-batch both use the stage's version current at its forward.
"""

from __future__ import annotations

import math

import torch

from hybridpipe.partitioner.plan import Plan
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.graphinfo import node_infos
from hybridpipe.profiles.zoo import resolve_model


def param_stages(model: torch.nn.Module, plan: Plan, spec, example) -> dict[str, int]:
    """Which stage owns each parameter (by the plan's node ranges over the captured blocks)."""
    out = {}
    captured = capture_model(model, example, granularity=plan.granularity, leaf_modules=spec.leaf_modules)
    for i, info in enumerate(node_infos(captured)):
        stage = next(s.index for s in plan.stages if s.first_node <= i <= s.last_node)
        for p in info.params:
            out[p] = stage
    return out


def train_pipedream_reference(plan: Plan, data, steps: int, drains: set[int], *, lr: float,
                              make_optimizer, seed: int = 0) -> dict[str, torch.Tensor]:
    """Final state dict after ``steps`` steps; the pipeline drains after the steps in ``drains``."""
    spec = resolve_model(plan.model)
    torch.manual_seed(seed)
    model = spec.build()
    owner = param_stages(model, plan, spec, data.batch(0, 0)[0])
    S, M = len(plan.stages), plan.micro_batches
    reps = [s.replicas for s in plan.stages]
    warm = [math.ceil(sum(reps[s:]) / reps[s]) for s in range(S)]
    live = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    names = [[n for n in live if owner[n] == s] for s in range(S)]
    opts = [make_optimizer([live[n] for n in names[s]], lr) for s in range(S)]
    versions = [[{n: live[n].detach().clone() for n in names[s]}] for s in range(S)]   # versions[s][v]
    pending = [dict() for _ in range(S)]     # round -> list of grad dicts
    base = 0
    for k in range(steps):
        for m in range(M):
            g = k * M + m
            used = {}
            for s in range(S):
                i = (g - base) // reps[s]
                v = base // reps[s] + max(0, i - warm[s] + 1)
                used.update({n: versions[s][v][n].clone().requires_grad_(True) for n in names[s]})
            x, y = data.batch(k, m)
            loss = spec.loss(torch.func.functional_call(model, used, (x,)), y)
            grads = dict(zip(used, torch.autograd.grad(loss, list(used.values())), strict=True))
            for s in range(S):
                rnd = g // reps[s]
                pending[s].setdefault(rnd, []).append({n: grads[n] for n in names[s]})
                if len(pending[s][rnd]) == reps[s]:
                    group = pending[s].pop(rnd)
                    for n in names[s]:
                        live[n].grad = sum(gd[n] for gd in group) / reps[s]
                    opts[s].step()
                    versions[s].append({n: live[n].detach().clone() for n in names[s]})
        if k in drains:
            base = (k + 1) * M
    return {n: t.detach() for n, t in live.items()} | {n: b for n, b in model.named_buffers()}
