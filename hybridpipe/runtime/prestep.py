"""What runs on a step's gradients right before the optimizer step (the engine's ``before_step``
hook, pipeline/engine.py): fp16's unscale and the ranks' agreed overflow check (runtime/scaler.py),
then clipping to a global gradient norm. Both are collective over the trainer's statistics group."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpipe.pipeline.ports import step_gradients
from hybridpipe.runtime.scaler import LossScaler
from hybridpipe.runtime.sharded_optimizer import norm_terms


class BeforeStep:
    """The hook: call it with every rank; False means every rank skips this step (an fp16 overflow).

    ``uncounted``: ids of the parameters whose gradient another stage's norm term already counts (a tied
    parameter counts only in the first stage that holds it). :attr:`group` (the statistics group) and
    :attr:`replica` (this rank's replica index: replica 0 of each stage contributes its squared norm)
    are the trainer's current ones (set again when it re-forms)."""

    def __init__(self, module: nn.Module, optimizer: Any, device: torch.device, scaler: LossScaler | None,
                 clip_grad_norm: float | None, uncounted: Collection[int]) -> None:
        self.module, self.optimizer, self.device = module, optimizer, device
        self.scaler, self.clip_grad_norm, self.uncounted = scaler, clip_grad_norm, uncounted
        self.group: Any = None
        self.replica = 0
        self.last_grad_norm: float | None = None     # the global norm before clipping, of the last step

    @property
    def needed(self) -> bool:
        """Whether there is anything to do before a step (no hook otherwise)."""
        return self.clip_grad_norm is not None or self.scaler is not None

    def __call__(self) -> bool:
        """fp16's unscale and agreed overflow check (False: every rank skips this step), then the
        clipping; a skipped step's norm is still taken (not finite, as ``clip_grad_norm_``'s after
        GradScaler's ``unscale_``), so :attr:`last_grad_norm` is never the step before's."""
        found = False
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            bad = torch.zeros(1, device=self.device)
            with torch.no_grad():
                for g in step_gradients(self.module, self.optimizer):
                    g.mul_(inv)
                    bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
            found = bool(bad.item() > 0)
            self.scaler.update(found)
        if self.clip_grad_norm is not None:
            self.clip(scale=not found)
        return not found

    def clip(self, scale: bool = True) -> None:
        """The global norm; with ``scale``, every gradient scaled by max_norm / norm when it exceeds
        ``clip_grad_norm``."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        grads = step_gradients(self.module, self.optimizer)
        for g in norm_terms(self.optimizer, self.module, self.replica == 0, self.uncounted):
            sq += g.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self.group)
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
        coef = float(self.clip_grad_norm or 0.0) / (norm + 1e-6)
        if scale and coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
