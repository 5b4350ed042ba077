"""HybridDataParallel: data parallelism with a per-layer, overlapped, hybrid all-reduce (seed 000).

As soon as backward has accumulated the gradients of a sync unit (a layer, or a few fused small
ones), a post-accumulate-grad hook queues the unit's all-reduce on a background communication
lane, with the algorithm the policy chose for it; backward goes on meanwhile. Nobody waits for
it until the unit is needed again: before its optimizer update (``finish()``, an attached
optimizer's step, or a :class:`LayerwiseOptimizer` update) or before its next forward (a forward
pre-hook on each of its modules). Gradients are reduced where they are: no fusion buffer.
Small units needed early in the next forward run on a second lane beside the first (policy.py),
so they do not wait behind the big syncs that backward started before them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpipe.comm.allreduce import AllReducer, Topology
from hybridpipe.comm.allreduce.costs import GroupCosts
from hybridpipe.comm.allreduce.transport import MAX_LANES
from hybridpipe.comm.engine import CommLane, Handle
from hybridpipe.comm.hybrid_dp.policy import SyncUnit, UnitChoice, check_policy, plan_units, units_from_choices
from hybridpipe.comm.hybrid_dp.units import model_layers
from hybridpipe.partitioner.cost.calibration import Calibration

log = logging.getLogger(__name__)
URGENT_LANE_OFFSET = MAX_LANES // 2


class HybridDataParallel(nn.Module):
    """Wrap ``module`` like ``DistributedDataParallel``: same results, per-layer overlapped sync.

    ``policy``: ``"hybrid"`` (per layer, by the cost model) or one algorithm for every layer.
    ``calibration``: a Calibration or path (``hybridpipe bench-allreduce``) for the cost model.
    ``reduce``: ``"mean"`` (DDP's semantics) or ``"sum"`` of the replicas' gradients.
    ``broadcast_buffers``: like DDP, buffers (e.g. BatchNorm statistics) follow the group's
    first rank at every forward; parameters and buffers are broadcast from it at construction.
    ``two_lanes``: urgent units on a second lane (message tags of lane ``lane + 128``).
    ``downward``: a second group of the same ranks for messages to lower positions (AllReducer).
    ``exclude``: parameters this wrapper never syncs (the caller sums their gradients itself).
    ``wire_dtype`` (e.g. ``torch.bfloat16``): floating gradients are cast to it for the
    all-reduce (half the bytes, the sum in that precision) and back into their own dtype after.
    ``units``: explicit choices instead of a policy (:class:`UnitChoice`: which parameters one
    all-reduce sums, with which algorithm, on which lane; e.g. a plan's), run exactly as given;
    ``policy``, ``fuse_small`` and ``two_lanes`` are then unused. :attr:`algorithms_run` tells
    what each parameter's all-reduce last ran.

    Every rank must run the same backward (the same parameters get gradients, as with DDP's
    default), but for the parameters in ``maybe_absent``: those of modules run as written (a
    mixture of experts' loop over the experts its tokens chose), which one replica's micro-batches
    may leave without a gradient while another's give them one. A unit holding any of them is
    all-reduced in :meth:`finish`, in unit order on every rank, a missing gradient as zeros, with
    one presence count per parameter beside it; a parameter no replica gave a gradient gets none
    (``.grad`` None: the optimizer skips it, as in one process), the others the sum (DDP's
    ``find_unused_parameters``). A parameter is awaited before the forward of the module that owns
    it (the first that registers it); one read earlier in forward by another module (an unusual
    weight tie) needs ``finish()`` before that forward.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, policy: str = "hybrid",
                 calibration: Calibration | str | os.PathLike | None = None, reduce: str = "mean", *,
                 topology: Topology | None = None, costs: GroupCosts | None = None, aggregator: str | None = None,
                 lane: int = 1, broadcast_buffers: bool = True, fuse_small: bool = True, two_lanes: bool = True,
                 downward: dist.ProcessGroup | None = None, units: Sequence[UnitChoice] | None = None,
                 exclude: Collection[nn.Parameter] = (), wire_dtype: torch.dtype | None = None,
                 maybe_absent: Collection[nn.Parameter] = ()):
        super().__init__()
        self.wire_dtype = wire_dtype          # floating gradients travel in this dtype (bf16: half the bytes)
        check_policy(policy)
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self.module = module
        self.group = group
        self.policy = policy
        self.reduce = reduce
        self.broadcast_buffers = broadcast_buffers
        self._reducer = AllReducer(group, topology=topology, calibration=calibration, costs=costs,
                                   aggregator=aggregator, lane=lane, downward=downward)
        self._lane = CommLane(f"hybridpipe-hdp-lane{lane}")
        self._src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        if units is not None:
            self.units: list[SyncUnit] = units_from_choices(model_layers(module, exclude), units)
        else:
            self.units = plan_units(model_layers(module, exclude), policy, self._reducer.costs, fuse_small=fuse_small,
                                    two_lanes=two_lanes)
        self._ran: dict[int, str] = {}                 # unit index -> the algorithm its last all-reduce ran
        # (unit name, algorithm, bytes, t0, t1) of each unit's all-reduce, perf_counter seconds, on its lane's
        # thread: a timeline recorder's ``on_sync`` (the all-reduce's own time, apart from the wait for it)
        self.on_reduce: Callable[[str, str, int, float, float], None] | None = None
        self._lanes = [(self._lane, self._reducer)]
        if any(u.lane == 1 for u in self.units):
            urgent = lane + URGENT_LANE_OFFSET
            if urgent >= MAX_LANES:
                raise ValueError(f"lane must be < {MAX_LANES - URGENT_LANE_OFFSET} with two lanes, got {lane}")
            self._lanes.append((CommLane(f"hybridpipe-hdp-lane{urgent}"),
                                AllReducer(group, topology=self._reducer.topology, costs=self._reducer.costs,
                                           lane=urgent, downward=downward)))
        self._unit_of: dict[int, SyncUnit] = {id(p): u for u in self.units for p in u.params}
        absent = {id(p) for p in maybe_absent}
        self._dynamic = {u.index for u in self.units if any(id(p) in absent for p in u.params)}
        self._backward_seen = False                    # a gradient arrived since the dynamic units last ran
        self._ready: dict[int, int] = {}               # unit index -> params ready this backward
        self._pending: dict[int, Handle] = {}          # unit index -> all-reduce in flight
        self._syncing = True
        self._before_use: list = []                    # callbacks(unit) run after a unit's wait
        self._buffers_sent: Handle | None = None
        self._hooks = []
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
            for layer in u.layers:
                self._hooks.append(layer.module.register_forward_pre_hook(self._make_pre_hook(u)))
        self._sync_module_state()
        log.debug("HDP on %d ranks: %s", self._reducer.size,
                  ", ".join(f"{u.name}:{u.algorithm}" for u in self.units))

    # ---- what was chosen -------------------------------------------------------------------
    @property
    def choices(self) -> dict[str, str]:
        """Sync unit name -> algorithm."""
        return {u.name: u.algorithm for u in self.units}

    @property
    def plan(self) -> list[dict]:
        """Per sync unit: name, bytes, algorithm, lane, predicted milliseconds (for reports)."""
        return [{"unit": u.name, "bytes": u.nbytes, "algorithm": u.algorithm, "lane": u.lane,
                 "predicted_ms": u.predicted_ms} for u in self.units]

    @property
    def algorithms_run(self) -> dict[str, str]:
        """Qualified parameter name -> the algorithm its unit's last all-reduce ran (as the reducer
        reported it); parameters whose unit has not run yet are left out."""
        return {name: self._ran[u.index] for u in self.units if u.index in self._ran for name in u.param_names}

    def in_flight(self) -> list[str]:
        """Names of the units whose all-reduce was started and not yet waited for."""
        return [u.name for u in self.units if u.index in self._pending]

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # DDP gives every forward the first rank's buffers as they were after its last forward;
        # we send them right after that forward, ahead of backward's all-reduces on the lane.
        if self._buffers_sent is not None:
            self._buffers_sent.wait()
            self._buffers_sent = None
        out = self.module(*args, **kwargs)
        for unit in self.units:                    # units whose modules did not run: before backward
            self.wait_unit(unit)
        if self.broadcast_buffers and self._reducer.size > 1:
            buffers = [b for b in self.module.buffers() if b.numel() > 0]
            if buffers:
                self._buffers_sent = self._lane.submit(self._broadcast, buffers, name="buffers")
        return out

    def _make_pre_hook(self, unit: SyncUnit):
        def hook(_module: nn.Module, _inputs: Any) -> None:
            self.wait_unit(unit)
        return hook

    # ---- backward --------------------------------------------------------------------------
    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._syncing:
            return
        self._backward_seen = True
        unit = self._unit_of[id(param)]
        if unit.index in self._dynamic:            # all-reduced in finish(), in order on every rank
            return
        count = self._ready.get(unit.index, 0) + 1
        if count < len(unit.params):
            self._ready[unit.index] = count
            return
        self._ready.pop(unit.index, None)
        self._launch(unit)

    def _launch(self, unit: SyncUnit) -> None:
        if unit.index in self._pending:            # a second backward before the wait: queue behind
            self._pending.pop(unit.index).wait()
        if unit.index in self._dynamic:
            self._launch_dynamic(unit)
            return
        grads = [p.grad for p in unit.params if p.grad is not None]
        if grads:
            ready = None
            if grads[0].is_cuda:                   # the lane must not read before backward wrote
                ready = torch.cuda.Event()
                ready.record()
            lane, reducer = self._lanes[unit.lane]
            self._pending[unit.index] = lane.submit(self._reduce_grads, unit.index, reducer, grads, unit.algorithm,
                                                    ready, unit.name, name=unit.name)

    def _launch_dynamic(self, unit: SyncUnit) -> None:
        """All-reduce a unit whose parameters may lack a gradient on some ranks: every parameter's
        gradient (zeros where missing) and a presence count per parameter, in one all-reduce."""
        params = [p for p in unit.params if p.requires_grad]
        if not params:
            return
        present = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        ready = None
        if present.is_cuda:                        # the lane must not read before backward (and the zeros) wrote
            ready = torch.cuda.Event()
            ready.record()
        lane, reducer = self._lanes[unit.lane]

        def reduce() -> None:
            self._reduce_grads(unit.index, reducer, [*grads, present], unit.algorithm, ready, unit.name)
            for p, n in zip(params, present.tolist(), strict=True):
                if n == 0:                         # no rank had one: none, as one process has none
                    p.grad = None
        self._pending[unit.index] = lane.submit(reduce, name=unit.name)

    def _reduce_grads(self, index: int, reducer: AllReducer, grads: list[torch.Tensor], algorithm: str,
                      ready: Any = None, name: str = "") -> None:
        if ready is not None:
            ready.synchronize()
        t0 = time.perf_counter() if self.on_reduce is not None else 0.0
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            if g.is_sparse:
                raise ValueError("HybridDataParallel sums dense gradients only")
            by_kind.setdefault((g.dtype, g.device), []).append(g)
        for same in by_kind.values():
            if self.wire_dtype is not None and same[0].is_floating_point() and same[0].dtype != self.wire_dtype:
                low = [g.to(self.wire_dtype) for g in same]
                self._ran[index] = reducer(low, algorithm)
                for g, w in zip(same, low, strict=True):
                    g.copy_(w)
            else:
                self._ran[index] = reducer(same, algorithm)
            if self.reduce == "mean":
                for g in same:
                    g.div_(reducer.size)
        if ready is not None:                      # the waiter's stream then sees the sums
            torch.cuda.current_stream().synchronize()
        if self.on_reduce is not None:
            self.on_reduce(name, self._ran.get(index, algorithm), sum(g.numel() * g.element_size() for g in grads),
                           t0, time.perf_counter())

    # ---- waiting ---------------------------------------------------------------------------
    def wait_unit(self, unit: SyncUnit) -> None:
        """Wait for ``unit``'s all-reduce, if one is in flight, then run the before-use callbacks."""
        handle = self._pending.pop(unit.index, None)
        if handle is not None:
            handle.wait()
        for callback in self._before_use:
            callback(unit)

    def launch_partial(self) -> None:
        """Start the all-reduce of units whose backward left them partly ready (parameters that
        got no gradient this step) and, after a backward, of the units whose parameters may lack
        one (``maybe_absent``), in unit order, so every rank starts the same ones."""
        if self._syncing:
            dynamic, self._backward_seen = self._backward_seen, False
            for unit in self.units:
                if self._ready.pop(unit.index, None) or (dynamic and unit.index in self._dynamic):
                    self._launch(unit)

    def finish(self) -> None:
        """Wait for every started all-reduce (after :meth:`launch_partial`): ``.grad`` holds the
        reduced values afterwards."""
        self.launch_partial()
        for unit in self.units:
            handle = self._pending.pop(unit.index, None)
            if handle is not None:
                handle.wait()
        if self._buffers_sent is not None:
            self._buffers_sent.wait()
            self._buffers_sent = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside starts no all-reduce; gradients accumulate locally."""
        before = self._syncing
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = before

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for the all-reduces first (a step pre-hook)."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.finish()))

    def add_before_use(self, callback) -> None:
        """Run ``callback(unit)`` whenever a unit's sync has been waited for (LayerwiseOptimizer)."""
        self._before_use.append(callback)

    def close(self) -> None:
        """Wait for what is in flight, remove the hooks, stop the lane."""
        self.finish()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for lane, reducer in self._lanes:
            lane.close()
            reducer.close()

    def abandon(self) -> None:
        """Stop syncing without waiting (the group's connections were cut, a peer is gone): the
        hooks are removed, all-reduces in flight forgotten, the lanes' threads end after their
        current job."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pending.clear()
        self._ready.clear()
        self._buffers_sent = None
        for lane, _ in self._lanes:
            lane.close(timeout=0)

    def sum_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group, as it is (no wire dtype), after what is in
        flight (on the lane, in order with the gradient all-reduces; e.g. batch statistics)."""
        self.finish()
        if self._reducer.size > 1:
            self._lane.submit(self._sum, tensor, name="sum_replicas").wait()

    def _sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    # ---- state -----------------------------------------------------------------------------
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            dist.broadcast(t, src=self._src, group=self.group)

    def _sync_module_state(self) -> None:
        if self._reducer.size <= 1:
            return
        with torch.no_grad():
            state = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
            self._lane.submit(self._broadcast, [t for t in state if t.numel() > 0], name="initial state").wait()
