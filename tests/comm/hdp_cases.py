"""Worker functions for the HybridDataParallel tests: train the same model with torch DDP and
with HDP side by side in every rank (each on its own process group), on different data per
rank, and report how far their weights drifted apart."""

from __future__ import annotations

import copy
import functools

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
