"""What one training step of a rank returns (``PipelineEngine.run_step``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepResult:
    step: int
    losses: dict[int, torch.Tensor] = field(default_factory=dict)   # last stage: micro-batch of this step -> loss
    counts: dict[int, torch.Tensor] = field(default_factory=dict)   # with tokens: micro-batch -> its tokens
    total: tuple[float, float] | None = None     # with tokens: the step's (loss sum, tokens) over every rank
    optimizer_steps: int = 0
    peak_memory_bytes: int = 0      # what the stage held at its peak this step (memory.py; 0: not measured)

    @property
    def mean_loss(self) -> float | None:
        if self.total is not None:
            return self.total[0] / self.total[1] if self.total[1] > 0 else float("nan")
        return float(torch.stack(list(self.losses.values())).mean()) if self.losses else None
