"""The optimizer of a rank whose stage shards its replicas' optimizer state (ZeRO-1/2/3).

:class:`ShardedOptimizer` is a ``torch.optim.Optimizer`` over the rank's parameters (so learning-rate
schedulers, ``param_groups`` and checkpoints see the usual thing) that runs the user's SGD, Adam or
AdamW on *this replica's pieces* of the sharded parameters: 1-D views into the parameters' own
storage (comm/sharded: the ranges this position owns after each sync unit's reduce-scatter; ZeRO-3:
the owned pieces themselves, the parameters' storages being freed between uses), with
the summed gradient of the same range. Those optimizers are elementwise, so the update of every
element equals the unsharded optimizer's up to the order of the replicas' sum; their state (momentum,
Adam's moments) exists for the owned ranges only: 1/R of it per replica. After the update each
unit's weights are all-gathered from their owners. Parameters outside the sync units (tied weights,
synced across stages by the TiedSync) keep a whole state on every replica.

Checkpoints stay plan-independent: :meth:`ShardedOptimizer.state_dict` (collective over the
replica groups) all-gathers the state into torch's own format over the whole parameters, and
:meth:`~ShardedOptimizer.load_state_dict` keeps each replica's ranges of such a state, so a sharded
run resumes replicated, at another shard level or on another plan, and the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe.comm.sharded import Piece, ShardedReplicas
from hybridpipe.errors import UserError

SPLITTABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
SCALAR_KEYS = ("step",)            # state entries that are one number per parameter, not one per element

Make = Callable[[list], Any]      # the user's optimizer factory: parameters -> optimizer


class ShardedOptimizer(torch.optim.Optimizer):
    """``make(tensors)`` builds the user's optimizer (SGD, Adam or AdamW, any parameter groups: its
    groups become this optimizer's, for schedulers and checkpoints); :meth:`bind` gives an inner
    optimizer of the same type the replicas' shards, each piece in its parameter's group (again after
    the syncs are rebuilt). See the module docstring."""

    def __init__(self, params: Iterable[nn.Parameter], make: Make):
        params = [p for p in params if p.requires_grad]
        probe = make(params)
        if type(probe) not in SPLITTABLE:
            raise UserError(f"a sharded stage (shard != none) splits the optimizer's state across its replicas; "
                            f"{type(probe).__name__} cannot be split (its update is not elementwise): use sgd, "
                            "adam or adamw, or \"shard\": \"none\"")
        super().__init__([{**_hyper(g), "params": list(g["params"])} for g in probe.param_groups], probe.defaults)
        self.shards: list[ShardedReplicas] = []
        self.pieces: list[Piece] = []
        self.views: list[torch.Tensor] = []
        self.whole: list[nn.Parameter] = self._params()
        self.inner = probe
        self.state = probe.state
        self._state_template: dict[str, Any] | None = None

    def bind(self, shards: Sequence[ShardedReplicas]) -> None:
        """Run on ``shards``' owned pieces (once, before the first step)."""
        if self.shards or any(self.inner.state.values()):
            raise RuntimeError("a sharded optimizer is bound to its replicas' shards once, before any step")
        self.shards = list(shards)
        sharded = {id(p) for s in self.shards for p in s.sharded}
        self.pieces = [pc for s in self.shards for pc in s.pieces()]
        self.views = [v for s in self.shards for v in s.owned_views()]
        self.whole = [p for p in self._params() if id(p) not in sharded]
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        members: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for pc, v in zip(self.pieces, self.views, strict=True):
            members[group_of[id(pc.param)]].append(v)
        for p in self.whole:
            members[group_of[id(p)]].append(p)
        self.inner = type(self.inner)([{**_hyper(g), "params": m} for g, m in zip(self.param_groups, members,
                                                                                   strict=True)])
        self.state = self.inner.state

    def _params(self) -> list[nn.Parameter]:
        """Every parameter, group by group (the order of torch's state_dict indices)."""
        return [p for g in self.param_groups for p in g["params"]]

    # ---- the step --------------------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor | None]:
        """Each owned piece's summed gradient (None where there is none)."""
        return [g for s in self.shards for g in s.owned_grads()]

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the step reads (the engine scales them, fp16 unscales them, clipping scales them)."""
        return [g for g in self.owned_grads() if g is not None] + [p.grad for p in self.whole if p.grad is not None]

    def norm_terms(self, first_replica: bool, uncounted: Collection[int] = ()) -> list[torch.Tensor]:
        """The gradients whose squares sum, over every rank, to the model's squared norm: every
        replica's owned pieces; the whole (replicated) parameters' on the first replica only,
        but ``uncounted`` ones (ids: tied copies counted in another stage)."""
        whole = [p.grad for p in self.whole if p.grad is not None and id(p) not in uncounted] if first_replica else []
        return [g for g in self.owned_grads() if g is not None] + whole

    def shard_tensors(self) -> list[torch.Tensor]:
        """The weights this rank holds apart from its parameters (ZeRO-3: the owned pieces; the memory meter)."""
        return [v for s in self.shards if s.weights is not None for v in s.owned_views()]

    def grad_bytes(self) -> int:
        """Gradient bytes this rank holds at the step's peak (comm/sharded full_grad_bytes per shard)."""
        return sum(s.full_grad_bytes() for s in self.shards) + sum(p.numel() * p.element_size() for p in self.whole)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the owned pieces and the whole parameters, then all-gather the weights."""
        loss = closure() if closure is not None else None
        for s in self.shards:
            s.finish()
            s.agree_present()           # a parameter no replica had a gradient for is skipped, as torch does
        for inner, group in zip(self.inner.param_groups, self.param_groups, strict=True):
            inner.update(_hyper(group))        # a scheduler moves the outer groups
        for v, g in zip(self.views, self.owned_grads(), strict=True):
            v.grad = g
        self.inner.step()
        for v in self.views:
            v.grad = None
        for s in self.shards:
            s.gather_weights()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.drop_grads()
        for p in self.whole:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format over the whole parameters: collective (every replica of every sharded
        stage of this rank calls it), the owned pieces all-gathered."""
        index = {id(p): i for i, p in enumerate(self._params())}
        state: dict[int, dict[str, Any]] = {}
        for p in self.whole:
            if self.inner.state.get(p):
                state[index[id(p)]] = dict(self.inner.state[p])
        for shard in self.shards:
            for p, full in self._gathered(shard).items():
                state[index[id(p)]] = full
        groups = [{**_hyper(g), "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def _gathered(self, shard: ShardedReplicas) -> dict[nn.Parameter, dict[str, Any]]:
        """The whole state of each of ``shard``'s parameters that has one (collective over its replicas):
        the per-element entries all-gathered from the pieces; the scalar ones (Adam's step count) and
        whether there is a state at all from the replica that owns the parameter's first element
        (every piece of a parameter is stepped on the same steps, and the parameters of a unit on
        different ones: an expert no token chose is skipped)."""
        ids = {id(q) for q in shard.pieces()}
        mine = [(pc, v) for pc, v in zip(self.pieces, self.views, strict=True) if id(pc) in ids]
        template = self._template()
        counted = [k for k, v in template.items() if isinstance(v, torch.Tensor) and v.dim() == 0]
        keys = [k for k, v in template.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        params = shard.sharded
        row = {id(p): i for i, p in enumerate(params)}
        facts = torch.zeros(max(len(params), shard.size), 1 + len(counted), dtype=torch.float64,
                            device=params[0].device if params else None)
        for pc, v in mine:
            st = self.inner.state.get(v)
            if pc.lo == 0 and st:
                facts[row[id(pc.param)]] = torch.tensor([1.0] + [float(st[k]) for k in counted], dtype=torch.float64)
        shard.sum_replicas(facts)
        known = facts.cpu().tolist()
        has = {id(p) for p in params if known[row[id(p)]][0] > 0}
        if not has:                         # no step yet (or no gradient ever): no state anywhere
            return {}
        full: dict[nn.Parameter, dict[str, Any]] = {}
        for p in params:
            if id(p) in has:
                full[p] = {k: _placed(v, None) for k, v in template.items() if k not in keys and k not in counted}
                for j, k in enumerate(counted):
                    full[p][k] = torch.tensor(known[row[id(p)]][1 + j], dtype=template[k].dtype,
                                              device=template[k].device)
        for key in keys:
            per_unit = []
            for unit in shard.units:
                tensors = {id(p): torch.zeros_like(p) for p in unit.unit.params}
                for pc, v in mine:
                    if id(pc.param) in tensors and self.inner.state.get(v):
                        tensors[id(pc.param)].view(-1)[pc.lo:pc.hi].copy_(self.inner.state[v][key])
                per_unit.append(list(tensors.values()))
                for p, t in zip(unit.unit.params, per_unit[-1], strict=True):
                    if id(p) in has:
                        full[p][key] = t
            shard.gather(per_unit)
        return full

    def _template(self) -> dict[str, Any]:
        """The state the inner optimizer keeps for one parameter after a step (its entries, which are
        per element and which scalar), found by stepping a copy of its first group on one element."""
        if self._state_template is None:
            like = self._params()[0]
            probe = torch.zeros(1, dtype=like.dtype, device=like.device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            step = type(self.inner)([{**_hyper(self.param_groups[0]), "params": [probe]}])
            step.step()
            self._state_template = dict(step.state[probe])
        return self._state_template

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take torch's format over the whole parameters (a replicated or sharded run's; each
        replica keeps its own pieces) and its hyperparameters."""
        index = {id(p): i for i, p in enumerate(self._params())}
        saved = {int(k): v for k, v in state_dict["state"].items()}
        for group, given in zip(self.param_groups, state_dict["param_groups"], strict=False):
            group.update(_hyper(given))
        self.inner.state.clear()
        for p in self.whole:
            if index[id(p)] in saved:
                self.inner.state[p] = {k: _placed(v, p) for k, v in saved[index[id(p)]].items()}
        for pc, v in zip(self.pieces, self.views, strict=True):
            st = saved.get(index[id(pc.param)])
            if st:
                self.inner.state[v] = {k: _piece_of(t, pc) if k not in SCALAR_KEYS else _placed(t, None)
                                       for k, t in st.items()}


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (all but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _piece_of(value: Any, pc: Piece) -> Any:
    """A per-element state entry of the whole parameter, cut to the piece (others as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    return _placed(value, pc.param).reshape(-1)[pc.lo:pc.hi].clone()


def _placed(value: Any, like: torch.Tensor | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if like is None or value.dim() == 0:
        return value.clone()
    return value.to(device=like.device, dtype=like.dtype).clone()


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` (possibly wrapped) is a :class:`ShardedOptimizer`."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), ShardedOptimizer)


class GatheredState:
    """A sharded optimizer's state gathered once (collective), for a checkpoint that only the
    first replica writes: ``state_dict()`` and ``param_groups`` as the optimizer's."""

    def __init__(self, optimizer: ShardedOptimizer):
        self.param_groups = optimizer.param_groups
        self._state = optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return self._state


def for_checkpoint(optimizer: Any) -> Any:
    """What a checkpoint reads of ``optimizer``: a sharded one's state gathered now (every rank
    calls this), else the optimizer itself."""
    return GatheredState(optimizer) if isinstance(optimizer, ShardedOptimizer) else optimizer


def norm_terms(optimizer: Any, module: nn.Module, first_replica: bool,
               uncounted: Collection[int]) -> list[torch.Tensor]:
    """The gradients whose squares this rank adds to the global norm (clipping)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.norm_terms(first_replica, uncounted)
    if not first_replica:
        return []
    return [p.grad for p in module.parameters() if p.grad is not None and id(p) not in uncounted]
