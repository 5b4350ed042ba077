"""What a rank holds for the micro-batches it is working on: the engine's per-micro-batch state, one owner.

Keyed by (stage, micro-batch numbered over the run): a micro-batch enters with its inputs (loaded
or received), is held as an activation from its forward to its backward, and leaves when its
input gradients are sent. The training engine (``engine.py``) fills and drains it, the checkpoint
(``engine_state.py``) saves and restores it, the evaluation step (``evaluation.py``) needs it empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridpipe.pipeline.splitback import WeightWork
from hybridpipe.pipeline.stage import Activation

Key = tuple[int, int]       # (stage, micro-batch numbered over the run)
Tensors = dict[str, torch.Tensor]


@dataclass
class InFlight:
    """The per-micro-batch state between instructions (see the module docstring)."""

    inputs: dict[Key, Tensors] = field(default_factory=dict)         # loaded or received, not yet forwarded
    targets: dict[Key, Any] = field(default_factory=dict)            # loaded, not yet given to the loss
    acts: dict[Key, Activation] = field(default_factory=dict)        # forwarded, not yet backwarded
    out_grads: dict[Key, Tensors] = field(default_factory=dict)      # received: grads of the outputs
    in_grads: dict[Key, Tensors] = field(default_factory=dict)       # computed: grads of the inputs, not yet sent
    weight_work: dict[Key, tuple[Activation, WeightWork]] = field(default_factory=dict)   # split backward's W owed
    sync_next: set[Key] = field(default_factory=set)     # whose backward starts the replicas' sync
    settled: int | None = None      # the step after which messages in transit were received early

    def micro_batches(self) -> list[int]:
        """Micro-batches (numbered over the run) forwarded but not yet backwarded."""
        return sorted({g for _, g in (*self.acts, *self.weight_work)})

    def empty(self) -> bool:
        """Nothing loaded, received or forwarded is waiting for its next instruction."""
        return not (self.acts or self.inputs or self.out_grads)

    def snapshot(self) -> dict[int, dict]:
        """What a checkpoint keeps of each forwarded micro-batch: copies of its inputs and, when
        already here, of its output gradients (its activation is recomputed from them)."""
        return {g: {"inputs": _clone(act.inputs), "grads": _clone(self.out_grads.get((s, g)))}
                for (s, g), act in self.acts.items()}


def _clone(tensors: Tensors | None) -> Tensors | None:
    return None if tensors is None else {k: t.detach().clone() for k, t in tensors.items()}
