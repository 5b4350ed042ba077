"""Weight stashing for the asynchronous (pipedream) schedule.

A micro-batch's forward runs on a frozen copy ("version") of the stage's parameters when an
optimizer step will happen before its backward; the backward then differentiates exactly the
function its forward computed, while the live parameters move on. Gradients still land in the
live parameters' ``.grad`` (so gradient-sync hooks fire as usual): each parameter enters the
forward through :class:`_StashedWeight`, whose value is the frozen copy and whose gradient flows
to the live parameter. A version is kept while a micro-batch that used it is in flight: at most
as many versions as micro-batches in flight, fewer when consecutive forwards share one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hybridpipe.pipeline.instructions import Backward, Forward, Instruction, Step


class _StashedWeight(torch.autograd.Function):
    """Value of ``frozen``, gradient to ``live``."""

    @staticmethod
    def forward(ctx, live: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return frozen.view_as(frozen)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class WeightStash:
    """Parameter versions of one stage: ``version`` counts optimizer steps since the start."""

    def __init__(self, module: nn.Module):
        self.params = dict(module.named_parameters())
        self.version = 0
        self._frozen: dict[int, dict[str, torch.Tensor]] = {}    # version -> parameter copies
        self._users: dict[int, set[int]] = {}                    # version -> micro-batches using it
        self._version_of: dict[int, int] = {}                    # micro-batch -> version of its forward

    def forward_params(self, micro_batch: int, frozen: bool) -> Mapping[str, torch.Tensor] | None:
        """Parameters for ``micro_batch``'s forward: the current version, frozen if ``frozen``
        (an optimizer step comes before its backward); None = use the live parameters."""
        v = self.version
        self._version_of[micro_batch] = v
        if not frozen:
            return None
        if v not in self._frozen:
            self._frozen[v] = {n: p.detach().clone() for n, p in self.params.items()}
        self._users.setdefault(v, set()).add(micro_batch)
        return {n: _StashedWeight.apply(p, self._frozen[v][n]) for n, p in self.params.items()}

    def replay_params(self, micro_batch: int) -> Mapping[str, torch.Tensor] | None:
        """Parameters to recompute ``micro_batch``'s forward with (after a restore): its stashed
        version, or None when that version is the live one."""
        v = self._version_of[micro_batch]
        if v not in self._frozen:
            if v != self.version:
                raise RuntimeError(f"micro-batch {micro_batch} used weight version {v}, which was not stashed")
            return None
        return {n: _StashedWeight.apply(p, self._frozen[v][n]) for n, p in self.params.items()}

    def backward_done(self, micro_batch: int) -> None:
        """Release ``micro_batch``'s version (dropped when no micro-batch in flight uses it)."""
        v = self._version_of.pop(micro_batch, None)
        users = self._users.get(v) if v is not None else None
        if v is not None and users is not None:
            users.discard(micro_batch)
            if not users:
                del self._users[v], self._frozen[v]

    def stepped(self) -> None:
        """The optimizer updated the live parameters: a new version begins."""
        self.version += 1

    def tensors(self) -> list[torch.Tensor]:
        """Every stashed copy kept now."""
        return [t for ps in self._frozen.values() for t in ps.values()]

    def versions_kept(self) -> int:
        return len(self._frozen)

    def version_of(self, micro_batch: int) -> int:
        return self._version_of[micro_batch]

    def state_dict(self) -> dict:
        """The version counter, the frozen versions and which micro-batch uses which (copies)."""
        return {"version": self.version,
                "frozen": {v: {n: t.clone() for n, t in ps.items()} for v, ps in self._frozen.items()},
                "version_of": dict(self._version_of)}

    def load_state_dict(self, state: Mapping) -> None:
        self.version = int(state["version"])
        self._frozen = {int(v): {n: t.to(self.params[n].device).clone() for n, t in ps.items()}
                        for v, ps in state["frozen"].items()}
        self._version_of = {int(m): int(v) for m, v in state["version_of"].items()}
        self._users = {}
        for m, v in self._version_of.items():
            if v in self._frozen:
                self._users.setdefault(v, set()).add(m)


def needs_frozen(program: Sequence[Instruction]) -> set[int]:
    """Micro-batches (relative) of a rank's list whose forward is followed by an optimizer step
    before their backward, in this list or because the backward is in a later step's list."""
    out: set[int] = set()
    open_: dict[int, bool] = {}
    for ins in program:
        if isinstance(ins, Forward):
            open_[ins.micro_batch] = False
        elif isinstance(ins, Step):
            for m in open_:
                open_[m] = True
        elif isinstance(ins, Backward) and ins.micro_batch in open_:
            if open_.pop(ins.micro_batch):
                out.add(ins.micro_batch)
    return out | set(open_)
