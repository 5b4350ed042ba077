"""Token-weighted loss on a pipeline (``--loss-normalization tokens``, profiles/losses.py).

A step's loss is then the sum of the per-token losses of the whole global batch divided by its
number of valid tokens N, counted over every micro-batch and replica, as one process computes it
on the global batch at once. N is known only once the step's last micro-batch is through the
last stage, but 1F1B runs the backward of micro-batch 0 before the forwards of later ones. So,
as Megatron-LM's ``calculate_per_token_loss`` does, each micro-batch's backward starts from its
loss *sum*, the gradients add up over micro-batches, replicas (their all-reduce sums) and tied
copies as always, and at the optimizer step, instead of the schedule's 1/M, they are multiplied
by 1/N, which one collective of two numbers (the step's loss sum and token count, nonzero only
on the last stage's ranks) gives every rank. What runs after that factor sees final gradients:
clipping by the global norm and fp16's unscale and overflow check. So that the backward's
gradients are one process's (loss sum / N: fp16 activations and the fp16 loss scale overflow at
65504, on the steps they overflow under torch's GradScaler, not M times sooner), the backward
starts from the sum divided by D, the tokens a step's micro-batches may hold (``divisor``: fixed
for the run, so a resumed run computes the same bits), and the step's factor is D / N: 1 when
every token is valid (fixed-length data), one rounding otherwise. zb-h1's and
zbv's split backward only move when the weight gradients are computed, before the step.
pipedream updates each stage after each micro-batch, with no global step at which N is known:
refused where the run is configured.

Counting: a loss function returning ``(loss_sum, count)`` counts on the last stage. A model that
computes its own mean loss (a Hugging Face model given ``labels``) is counted from each
micro-batch's input on the first stage (``count_input``); the count travels to the last stage
with the micro-batch's activations, under :data:`COUNT_KEY`, and the sum is mean x count.

    tokens = TokenCounts(total=all_reduce_two_numbers, count_input=label_counter(model), note=watch.note)
    engine = PipelineEngine(..., tokens=tokens)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridpipe.profiles.loss_normalization import check_normalization as check_normalization  # re-exported
from hybridpipe.profiles.losses import LossValue, is_pair, loss_mean, loss_pair

COUNT_KEY = "hybridpipe:tokens"     # in an activation message; no graph value has a colon in its name
Total = Callable[[torch.Tensor], torch.Tensor]    # (loss sum, count) of this rank -> of the whole step (collective)


class TokenCounts:
    """One engine's token bookkeeping (see the module docstring). ``total``: sums a float64
    tensor [loss sum, count] over every rank of the job (a collective every rank makes at its
    optimizer step); ``count_input``: a model's own-loss count of an input batch (None: the loss
    function returns (loss_sum, count)); ``note``: shown every loss sum (the non-finite check)."""

    def __init__(self, total: Total, count_input: Callable[[Any], torch.Tensor] | None = None,
                 note: Callable[[torch.Tensor], None] | None = None, divisor: float = 1.0) -> None:
        self.total, self.count_input, self.note = total, count_input, note
        self._counts: dict[tuple[int, int], torch.Tensor] = {}     # (stage, micro-batch) -> own-loss count
        self._sum: torch.Tensor | None = None       # this rank's part of the step's [loss sum, count]
        self.divisor = max(float(divisor), 1.0)     # D: a backward starts from loss sum / D

    def fresh(self) -> TokenCounts:
        """A new bookkeeping with the same functions (an evaluation step's)."""
        return TokenCounts(self.total, self.count_input, self.note, self.divisor)

    # ---- counts travelling with a micro-batch -------------------------------------------
    def loaded(self, key: tuple[int, int], batch: Any, device: torch.device) -> None:
        """The first stage loaded ``batch``: count it (own-loss models)."""
        if self.count_input is not None:
            self._counts[key] = torch.as_tensor(self.count_input(batch)).to(device=device, dtype=torch.float64)

    def outgoing(self, key: tuple[int, int], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Activations of ``key`` with its count added (own-loss models)."""
        count = self._counts.pop(key, None)
        return tensors if count is None else {**tensors, COUNT_KEY: count}

    def incoming(self, key: tuple[int, int], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Received activations without their count (kept for ``key``)."""
        if COUNT_KEY not in tensors:
            return tensors
        rest = dict(tensors)
        self._counts[key] = rest.pop(COUNT_KEY)
        return rest

    # ---- the loss ------------------------------------------------------------------------
    def split(self, key: tuple[int, int], value: LossValue) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(root of the backward, loss sum, count) of one micro-batch's loss value: the sum and
        count of the loss function's pair, or the model's own mean times the count that came with
        the micro-batch; the root is sum / D. Sum and count are added to this rank's part of the step."""
        if is_pair(value) or self.count_input is None:
            total, count = loss_pair(value)
        else:
            if key not in self._counts:
                raise RuntimeError(f"micro-batch {key[1]} reached the loss on stage {key[0]} without its token count")
            count = self._counts.pop(key)
            mean = loss_mean(value)
            # a micro-batch of no valid label: its mean is 0/0, its sum 0 (and its gradient 0)
            total = torch.where(count > 0, mean * count.to(mean.dtype), torch.zeros_like(mean))
        if self.note is not None:
            self.note(total)
        count = count.to(total.device)
        part = torch.stack([total.detach().double(), count])
        self._sum = part if self._sum is None else self._sum + part
        return total / self.divisor, total, count

    def step_total(self) -> tuple[float, float, float]:
        """Collective: the step's (loss sum, tokens) over every rank and the factor its gradients
        take, D / tokens (0 with no token); resets this rank's part."""
        part = self._sum if self._sum is not None else torch.zeros(2, dtype=torch.float64)
        self._sum = None
        if self._counts:
            raise RuntimeError(f"token counts of micro-batches {sorted(self._counts)} were never used")
        loss_sum, tokens = (float(x) for x in self.total(part))
        return loss_sum, tokens, self.divisor / tokens if tokens > 0 else 0.0
