"""Worker functions for the HybridDataParallel tests: train the same model with torch DDP and
with HDP side by side in every rank (each on its own process group), on different data per
rank, and report how far their weights drifted apart."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hybridpipe.comm.hybrid_dp import HybridDataParallel, LayerwiseOptimizer
from hybridpipe.profiles.zoo import resolve_model


class SmallCNN(nn.Module):
    """Conv + BatchNorm (buffers, small layers that get fused) + a linear head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)   # a bias before BatchNorm has a zero
        # gradient up to rounding noise, which Adam would blow up to full steps in either direction
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


class Wide(nn.Module):
    """Small early layers, then a 2 MB one: the early ones sync on HDP's second (urgent) lane."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(12, 64)
        self.wide = nn.Linear(64, 8192)
        self.head = nn.Linear(8192, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.wide(torch.relu(self.inp(x)))))


def build(model: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """(model, input sample shape, classes)."""
    torch.manual_seed(0)
    if model == "cnn":
        return SmallCNN(), (3, 8, 8), 5
    if model == "wide":
        return Wide(), (12,), 4
    spec = resolve_model("mlp[features=12,hidden=24,layers=2,classes=4]")
    return spec.build(), spec.sample_shape, spec.num_classes


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def batch(rank: int, step: int, micro: int, shape, classes: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(6, *shape, generator=g), torch.randint(0, classes, (6,), generator=g)


def compare_with_ddp(rank: int, world: int, runs: list[tuple], steps: int = 3) -> dict[str, float]:
    """For each run (model, optimizer, policy, mode): the largest |w_hdp - w_ddp| after ``steps``.

    mode: ``finish`` (finish() then step), ``attach`` (optimizer step pre-hook),
    ``layerwise`` (LayerwiseOptimizer, updates deferred to the next forward), ``accumulate``
    (two micro-batches per step, the first under no_sync).
    """
    g_ddp, g_hdp = dist.new_group(), dist.new_group()
    out = {}
    for model_name, opt_name, policy, mode in runs:
        base, shape, classes = build(model_name)
        ddp = DistributedDataParallel(copy.deepcopy(base), process_group=g_ddp)
        hdp = HybridDataParallel(copy.deepcopy(base), group=g_hdp, policy=policy)
        opt_d = make_optimizer(opt_name, ddp.parameters())
        if mode == "layerwise":
            opt_h = LayerwiseOptimizer(hdp, functools.partial(make_optimizer, opt_name))
        else:
            opt_h = make_optimizer(opt_name, hdp.parameters())
            if mode == "attach":
                hdp.attach_optimizer(opt_h)
        micro = 2 if mode == "accumulate" else 1
        for step in range(steps):
            for system, model, opt in (("ddp", ddp, opt_d), ("hdp", hdp, opt_h)):
                for m in range(micro):
                    x, y = batch(rank, step, m, shape, classes)
                    last = m == micro - 1
                    ctx = model.no_sync() if not last else _nullcontext()
                    with ctx:
                        nn.functional.cross_entropy(model(x), y).backward()
                if system == "hdp" and mode in ("finish", "accumulate"):
                    hdp.finish()
                opt.step()
                opt.zero_grad()
        if mode == "layerwise":
            opt_h.flush()
        hdp.finish()
        diffs = [float((a - b).abs().max()) for a, b in zip(ddp.module.state_dict().values(),
                                                             hdp.module.state_dict().values(), strict=True)
                 if a.is_floating_point()]
        out[f"{model_name}/{opt_name}/{policy}/{mode}"] = max(diffs)
        out[f"{model_name}/{opt_name}/{policy}/{mode}/lanes"] = sorted({u.lane for u in hdp.units})
        hdp.close()
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Routed(nn.Module):
    """An input layer, then ``experts`` linear layers of which each sample's route picks one (the
    route given with the batch: which experts get a gradient differs from rank to rank, one is
    never picked), then a head."""

    def __init__(self, experts: int = 4, width: int = 8, classes: int = 3):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.stack([self.experts[e](h[i]) for i, e in enumerate(route)])
        return self.head(torch.relu(h))


def routes(rank: int, step: int) -> list[int]:
    """Two samples' experts: rank 0 takes 0 then 1 (step by step), rank 1 always 2; expert 3 never
    runs, expert 1 only on rank 0's odd steps."""
    return [0, step % 2] if rank == 0 else [2, 2]


def compare_routed_with_ddp(rank: int, world: int, steps: int = 4) -> dict[str, float]:
    """HDP with the experts as ``maybe_absent`` vs DDP with ``find_unused_parameters``: the largest
    |w_hdp - w_ddp| by optimizer, and which experts' .grad each leaves None after the last step."""
    out: dict[str, Any] = {}
    for opt_name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                           ("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))):
        torch.manual_seed(0)
        base = Routed()
        ddp = DistributedDataParallel(copy.deepcopy(base), process_group=dist.new_group(), find_unused_parameters=True)
        hdp_module = copy.deepcopy(base)
        hdp = HybridDataParallel(hdp_module, group=dist.new_group(), policy="ring", fuse_small=False,
                                 maybe_absent=list(hdp_module.experts.parameters()))
        opts = {"ddp": make(ddp.parameters()), "hdp": make(hdp.parameters())}
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(2, 6, generator=g), torch.randint(0, 3, (2,), generator=g)
            for name, model in (("ddp", ddp), ("hdp", hdp)):
                nn.functional.cross_entropy(model(x, routes(rank, step)), y).backward()
                if name == "hdp":
                    hdp.finish()
                opts[name].step()
                if step == steps - 1:
                    out[f"{opt_name}/{name}/none"] = [e for e, m in enumerate(model.module.experts)
                                                      if m.weight.grad is None]
                opts[name].zero_grad()
        out[opt_name] = max(float((a - b).abs().max()) for a, b in zip(ddp.module.state_dict().values(),
                                                                        hdp.module.state_dict().values(), strict=True))
        hdp.close()
    return out
