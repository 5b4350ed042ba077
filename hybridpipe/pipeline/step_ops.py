"""The training engine's step-level instructions (engine.py): waiting for a chunk's replica sync
(``SyncWait``) and the optimizer ``Step``: tied copies summed, the step's gradient factor (1/M,
1/r, or 1/tokens; none left where the backward's seed applied it, loss_seed.py), the ``before_step``
hook (clipping, fp16's unscale and overflow check), the update and the gradients dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from typing_extensions import assert_never

from hybridpipe.pipeline.instructions import Step, StepInstruction, SyncWait
from hybridpipe.pipeline.ports import TiedReduce, step_gradients
from hybridpipe.pipeline.stash import WeightStash
from hybridpipe.pipeline.step_result import StepResult
from hybridpipe.pipeline.tokens import TokenCounts


class Stepping(Protocol):
    """What the step-level instructions use of an engine (``PipelineEngine`` is one)."""

    module: torch.nn.Module
    params: tuple[torch.nn.Parameter, ...]    # module.parameters(), listed once
    optimizer: Any
    syncs: dict[int, Any]
    tied: TiedReduce | None
    before_step: Callable[[], bool | None] | None
    tokens: TokenCounts | None
    stash: WeightStash | None
    loss_seed: float | None


def run_step_level(engine: Stepping, ins: StepInstruction, result: StepResult) -> None:
    """Run ``SyncWait`` or ``Step`` (``result``: the step's, counting the optimizer steps)."""
    match ins:
        case SyncWait():
            engine.syncs[ins.stage].finish()
        case Step():
            # seeded: the backward applied the factor already (x / x is exactly 1.0)
            scale = ins.grad_scale if engine.loss_seed is None else ins.grad_scale / engine.loss_seed
            if engine.tokens is not None:         # the step's summed gradients over its tokens (tokens.py)
                loss_sum, tokens, scale = engine.tokens.step_total()
                result.total = (loss_sum, tokens)
            optimizer_step(engine, scale)
            result.optimizer_steps += 1
        case _:
            assert_never(ins)


def optimizer_step(engine: Stepping, scale: float) -> None:
    """Sum the tied copies, multiply the step's gradients by ``scale``, run ``before_step`` (False:
    no update), step the optimizer and drop the gradients."""
    if engine.tied is not None:
        engine.tied.reduce()
    if scale != 1.0:
        grads = step_gradients(engine.module, engine.optimizer, engine.params)
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, scale)       # one call, not one per parameter
    if engine.before_step is not None and engine.before_step() is False:
        engine.optimizer.zero_grad(set_to_none=True)
        return
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    if engine.stash:
        engine.stash.stepped()
