"""Per-layer optimizer updates, deferred to each layer's next use (seed 000's full window).

With an ordinary optimizer every layer's sync must end before ``step()``. A
:class:`LayerwiseOptimizer` keeps one optimizer per sync unit; ``step()`` and ``zero_grad()``
only mark the units, and each unit is updated (then zeroed) right before its next forward,
after waiting for its own all-reduce, so a layer's sync may run until the forward reaches it
(window F_n - B_n). The result is the same as stepping one optimizer over all parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridpipe.comm.hybrid_dp.policy import SyncUnit
from hybridpipe.comm.hybrid_dp.wrapper import HybridDataParallel


class LayerwiseOptimizer:
    """``make(params)`` builds each unit's optimizer, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.1)``."""

    def __init__(self, hdp: HybridDataParallel, make: Callable[[list], torch.optim.Optimizer]):
        self.hdp = hdp
        self.optimizers = {u.index: make(list(u.params)) for u in hdp.units}
        self._units = {u.index: u for u in hdp.units}
        self._step_due: set[int] = set()
        self._zero_due: dict[int, bool] = {}        # unit -> set_to_none
        hdp.add_before_use(self._apply)

    @property
    def param_groups(self) -> list[dict]:
        """Every unit optimizer's groups (shared dicts: changing ``lr`` here changes it there)."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        """Mark every unit for an update at its next use (its all-reduce keeps running)."""
        self.hdp.launch_partial()
        self._step_due.update(self.optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero each unit's gradients right after its pending update (at once if none is due)."""
        for index, unit in self._units.items():
            if index in self._step_due:
                self._zero_due[index] = set_to_none
            else:
                self.hdp.wait_unit(unit)
                self.optimizers[index].zero_grad(set_to_none)

    def flush(self) -> None:
        """Apply every pending update now (e.g. before reading or saving the weights)."""
        for unit in self._units.values():
            self.hdp.wait_unit(unit)

    def _apply(self, unit: SyncUnit) -> None:
        if unit.index in self._step_due:
            self._step_due.discard(unit.index)
            self.optimizers[unit.index].step()
        if unit.index in self._zero_due:
            self.optimizers[unit.index].zero_grad(self._zero_due.pop(unit.index))

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {"units": {str(i): opt.state_dict() for i, opt in self.optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flush()
        for i, opt in self.optimizers.items():
            opt.load_state_dict(state["units"][str(i)])
