"""The fp16 loss scaler of a pipelined job (as torch.amp.GradScaler, with the verdict agreed by all ranks).

The last stage multiplies each micro-batch's loss by ``scale`` before its backward, so float16
activation gradients do not underflow; every stage's gradients then carry the factor. Before the
optimizer step each rank divides its gradients by ``scale`` and checks them: one all-reduce (MAX)
of "found inf/nan" over every rank makes the verdict the same everywhere, so an overflowing step
is skipped on every stage (no weight, no optimizer state changes) and ``scale`` backs off; after
``growth_interval`` good steps in a row it grows. :meth:`update` is the pure rule.
"""

from __future__ import annotations


class LossScaler:
    """Dynamic loss scale: ``update(found_inf)`` once per step on every rank (see the module docstring)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
