"""The Trainer's end of the step's news on gradient frames (pipeline/stepnews.py): where the plan's
lists prove it, the loss check's verdict and the step's mean loss reach every rank on the last
gradient frames of the step instead of by collectives (none per step, where a broadcast of the flag
before the update and one of the loss totals after the step ran).

The loss rank makes the note once per step, at its first carrying send (after its last loss):
``[signal, loss sum, micro-batches]`` in float64 (the watch's verdict signal, runtime/nonfinite.py),
the sum computed as the collective path computes it (:func:`loss_totals`), so every rank returns
the same bits as before. A rank that receives it hands the signal to the watch
(``NonFiniteWatch.heard``) and forwards the same tensor upstream.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.schedules import Topology, all_programs
from hybridpipe.pipeline.stepnews import NewsRoute, news_routes
from hybridpipe.runtime.nonfinite import NonFiniteWatch
from hybridpipe.runtime.training_config import TrainingConfig


def loss_totals(losses: Mapping[int, torch.Tensor], counts: Mapping[int, torch.Tensor] | None,
                device: torch.device, extra: int = 0) -> torch.Tensor:
    """float64 ``[..., loss sum, count]`` (``extra`` leading zeros): the sum of ``losses`` and their
    number (with ``counts``: the counted tokens); zeros where there are none."""
    t = torch.zeros(extra + 2, dtype=torch.float64, device=device)
    if losses:
        t[extra] = torch.stack([v.detach().double() for v in losses.values()]).sum()
        t[extra + 1] = len(losses) if counts is None else torch.stack([c.double() for c in counts.values()]).sum()
    return t


def carried_routes(plan: Plan, cfg: TrainingConfig) -> dict[int, NewsRoute] | None:
    """Every rank's route when the plan's lists prove the news can ride on gradient frames and the
    settings allow it; None keeps the collectives (a recovery in place checks every rank first;
    token-weighted losses agree their totals by a collective anyway; per-tensor channels carry one
    tensor per lane). The same answer on every rank (a function of the plan and settings only)."""
    if cfg.in_place or cfg.loss_normalization == "tokens" or cfg.comm_mode == "per-tensor" \
            or not plan.kind.flushed or plan.stages[-1].replicas != 1:
        return None
    return news_routes(all_programs(Topology.from_plan(plan), plan.kind, drain=False))


class FrameNews:
    """This rank's news of each step (the engine's ``news``; see the module docstring)."""

    def __init__(self, route: NewsRoute, watch: NonFiniteWatch, device: torch.device) -> None:
        self.route, self.watch, self.device = route, watch, device
        self._step: int | None = None
        self._note = torch.zeros(3, dtype=torch.float64, device=device)

    @property
    def makes(self) -> bool:
        """This rank makes the news (it runs the step's losses)."""
        return self.route.receive is None

    def outgoing(self, step: int, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """The note a carrying send attaches: made on the loss rank, else the one received."""
        if self._step != step:
            if not self.makes:
                raise RuntimeError(f"step {step}'s loss news is forwarded before it arrived (a route "
                                   "that the schedule's lists did not prove)")
            self._note = loss_totals(losses, None, self.device, extra=1)
            self._note[0] = self.watch.signal
            self._step = step
        return self._note

    def incoming(self, step: int, note: torch.Tensor) -> None:
        self._step, self._note = step, note
        self.watch.heard(note[0])

    def totals(self, step: int, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """float64 ``[loss sum, micro-batches]`` of ``step`` (``losses``: the loss rank's)."""
        return self.outgoing(step, losses)[1:]
