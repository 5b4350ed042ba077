"""Running statistics (batch norm's, and counters) that equal one process's on replicated stages,
and that a recomputed forward does not count twice.

On a stage whose training forward writes buffers (pipeline/buffer_writes.py) and that is
replicated or recomputes its activations, :func:`install` replaces each batch-norm call by a
:class:`BatchNormCall` and each counter ``buf.add_(c)`` by a :class:`CounterCall` (graph surgery
on the stage's GraphModule; the parameters and buffers stay the model's objects, the output is
what the replaced call computes). They change nothing unless the stage's :class:`RunningStats`
says that a micro-batch's own forward is running (``begin(key)`` ... ``end()``, PipelineStage
does it), so the forward torch.utils.checkpoint reruns inside the backward updates nothing. Then:

* ``direct`` (one replica that recomputes): the update happens at once, as the model's own call
  does it (the same kernel on the same buffers).
* ``combine`` (replicas): nothing is written during the forward; each batch-norm call records the
  micro-batch's statistics as batch norm's update uses them (mean and unbiased variance, taken from
  the same kernel on zeroed buffers with momentum 1, which outputs exactly what the replaced call
  outputs). After the step, :meth:`RunningStats.combine` sums a table of the step's micro-batches
  across the replicas -- each row comes from the one replica that ran that micro-batch, the others
  add zeros, so the sum is exact in any order -- and every replica replays the updates in
  micro-batch order: ``rm = (1 - m) rm + m mean``, ``rv = (1 - m) rv + m var``,
  ``num_batches_tracked += 1`` per micro-batch, ``m = 1 / num_batches_tracked`` for momentum None
  (the cumulative average). Replicas end bit-identical, equal to one process that ran the
  micro-batches in order up to the rounding of the update (an ulp of the statistic).

A micro-batch's statistics do not depend on the running ones in training mode, so replaying them
after the step equals updating them during it; evaluation reads them between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from hybridpipe.pipeline.buffer_writes import BATCH_NORM, COUNTER, BufferWrite

aten = torch.ops.aten
DIRECT, COMBINE = "direct", "combine"
PREFIX = "_hybridpipe_stats"            # the replacing calls' submodule names: _hybridpipe_stats_<k>


@dataclass(frozen=True)
class NormUpdate:
    """One batch-norm call's update of its running statistics (a row's ``offset`` .. + 2C)."""

    running_mean: str
    running_var: str
    counter: str | None         # num_batches_tracked when the call itself counts (a module's forward)
    momentum: float | None      # None: cumulative average
    channels: int
    offset: int


@dataclass(frozen=True)
class CountUpdate:
    """One ``buf.add_(amount)`` per micro-batch."""

    buffer: str
    amount: int | float


class RunningStats:
    """The running-statistics state of one stage (see the module docstring)."""

    def __init__(self, module: nn.Module, mode: str, updates: Sequence[NormUpdate | CountUpdate], width: int,
                 dtype: torch.dtype):
        self.module, self.mode = module, mode
        self.updates = tuple(updates)          # graph order
        self.width, self.dtype = width, dtype  # a table row: 1 (marker) + 2C per batch-norm call
        self.active: int | None = None          # the micro-batch whose own forward runs now
        self.recorded: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._calls = 0

    @property
    def combines(self) -> bool:
        return self.mode == COMBINE

    @property
    def layers(self) -> list[str]:
        """The batch-norm layers (their running mean's owner) whose statistics are kept here."""
        return list(dict.fromkeys(u.running_mean.rpartition(".")[0] for u in self.updates
                                  if isinstance(u, NormUpdate)))

    @property
    def buffers(self) -> list[str]:
        """Every buffer these updates write."""
        names: list[str] = []
        for u in self.updates:
            names += [u.running_mean, u.running_var, *([u.counter] if u.counter else [])] \
                if isinstance(u, NormUpdate) else [u.buffer]
        return list(dict.fromkeys(names))

    def begin(self, key: int | None = None) -> None:
        """A micro-batch's own forward starts (``key``: its number over the run; default: calls so far)."""
        self.active = self._calls if key is None else key
        self._calls += 1
        if self.mode == COMBINE:
            self.recorded.setdefault(self.active, {})

    def end(self) -> None:
        self.active = None

    def record(self, index: int, mean: torch.Tensor, var: torch.Tensor) -> None:
        if self.active is None:
            raise RuntimeError("batch statistics recorded outside a micro-batch's forward")
        self.recorded.setdefault(self.active, {})[index] = (mean, var)

    def table(self, keys: Sequence[int]) -> torch.Tensor:
        """This replica's rows of the step's micro-batches ``keys`` (in order), zeros for the others."""
        extra = sorted(set(self.recorded) - set(keys))
        if extra:
            raise RuntimeError(f"batch statistics of micro-batches {extra} are not among this step's {list(keys)}")
        device = next((b.device for b in self.module.buffers()), torch.device("cpu"))
        zeros = torch.zeros(self.width, dtype=self.dtype, device=device)
        one = torch.ones(1, dtype=self.dtype, device=device)
        n_norms = sum(isinstance(u, NormUpdate) for u in self.updates)
        rows = []
        for key in keys:
            got = self.recorded.get(key)
            rows.append(zeros if got is None else torch.cat(
                [one, *(t.reshape(-1).to(self.dtype) for i in range(n_norms) for t in got[i])]))
        return torch.stack(rows) if rows else zeros.new_zeros(0, self.width)

    def combine(self, keys: Sequence[int], sum_replicas: Callable[[torch.Tensor], None]) -> None:
        """Every replica's statistics of the step's micro-batches ``keys`` (numbered over the run,
        in order), summed by ``sum_replicas`` (in place, across the stage's replicas), replayed."""
        table = self.table(keys)
        self.recorded.clear()
        if not keys:
            return
        sum_replicas(table)
        marks = table[:, 0].tolist()
        if any(m != 1 for m in marks):
            raise RuntimeError(f"batch statistics of the step's micro-batches came from {marks} replicas each, "
                               "not one: the replicas' schedules or gradient syncs disagree")
        self.replay(table)

    def replay(self, table: torch.Tensor) -> None:
        """Apply the updates of the table's rows, row by row (micro-batch order), each row's in
        graph order, to the stage's buffers (batch norms of one momentum whose buffers differ
        in one fused step)."""
        n = table.shape[0]
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            counters = [buffers[u.buffer] for u in self.updates if isinstance(u, CountUpdate)
                        and not buffers[u.buffer].is_floating_point()]     # integers: nobody reads them meanwhile
            amounts = [u.amount * n for u in self.updates if isinstance(u, CountUpdate)
                       and not buffers[u.buffer].is_floating_point()]
            for buf, amount in zip(counters, amounts, strict=True):
                buf.add_(amount)
            groups = self._groups()
            for row in table:
                for group in groups:
                    self._apply(group, row, buffers)

    def _groups(self) -> list[list[NormUpdate | CountUpdate]]:
        """The updates in an order that gives the same result: batch norms in graph order, those
        of one fixed momentum in one fused step until one repeats a buffer (a layer called twice);
        counters (nothing reads them, they read nothing) after them."""
        out: list[list[NormUpdate | CountUpdate]] = []
        for u in self.updates:
            last = out[-1] if out else None
            if (isinstance(u, NormUpdate) and u.momentum is not None and u.counter is None and last
                    and isinstance(last[0], NormUpdate) and last[0].momentum == u.momentum
                    and last[0].counter is None
                    and u.running_mean not in {v.running_mean for v in last if isinstance(v, NormUpdate)}):
                last.append(u)
            elif isinstance(u, NormUpdate):
                out.append([u])
        return out + [[u] for u in self.updates if isinstance(u, CountUpdate)]

    def _apply(self, group: list[NormUpdate | CountUpdate], row: torch.Tensor, buffers: dict[str, torch.Tensor]
               ) -> None:
        first = group[0]
        if isinstance(first, CountUpdate):
            if buffers[first.buffer].is_floating_point():
                buffers[first.buffer].add_(first.amount)
            return
        norms = [u for u in group if isinstance(u, NormUpdate)]
        m = first.momentum
        if first.counter is not None:
            counter = buffers[first.counter]
            counter.add_(1)
            if m is None:
                m = 1.0 / float(counter)
        means = [buffers[u.running_mean] for u in norms]
        variances = [buffers[u.running_var] for u in norms]
        _mix(means, [_slice(row, u, 0, t) for u, t in zip(norms, means, strict=True)], float(m or 0.0),
             variances, [_slice(row, u, 1, t) for u, t in zip(norms, variances, strict=True)])


def _slice(row: torch.Tensor, u: NormUpdate, which: int, like: torch.Tensor) -> torch.Tensor:
    start = u.offset + which * u.channels
    return row[start:start + u.channels].reshape(like.shape).to(like.dtype)


def _mix(means: list[torch.Tensor], new_means: list[torch.Tensor], m: float, variances: list[torch.Tensor],
         new_vars: list[torch.Tensor]) -> None:
    """``rm = (1 - m) rm + m mean`` and ``rv = (1 - m) rv + m var`` in place, as the CPU kernel
    rounds them (its variance update is a fused multiply-add, its mean's is not)."""
    scaled = torch._foreach_mul(new_means, m)
    torch._foreach_mul_(means, 1 - m)
    torch._foreach_add_(means, scaled)
    torch._foreach_mul_(variances, 1 - m)
    torch._foreach_add_(variances, new_vars, alpha=m)


class BatchNormCall(nn.Module):
    """A batch-norm call in training mode whose running statistics the stage's RunningStats governs."""

    def __init__(self, stats: RunningStats | None, index: int, momentum: float | None, eps: float,
                 cudnn: bool | None):
        super().__init__()
        self.stats, self.index = stats, index
        self.momentum, self.eps, self.cudnn = momentum, eps, cudnn

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor, running_var: torch.Tensor, counter: torch.Tensor | None = None
                ) -> torch.Tensor:
        cudnn = torch.backends.cudnn.enabled if self.cudnn is None else self.cudnn
        stats = self.stats
        if stats is None or stats.active is None:      # a recomputed forward: normalize, update nothing
            # (on scratch statistics: autograd saves the same tensors as in the forward it repeats)
            return torch.batch_norm(x, weight, bias, torch.zeros_like(running_mean), torch.ones_like(running_var),
                                    True, 0.0, self.eps, cudnn)
        if stats.mode == DIRECT:
            m = self.momentum
            if counter is not None:
                counter.add_(1)
                if m is None:
                    m = 1.0 / float(counter)
            return torch.batch_norm(x, weight, bias, running_mean, running_var, True, float(m or 0.0), self.eps,
                                    cudnn)
        mean, var = torch.zeros_like(running_mean), torch.zeros_like(running_var)
        out = torch.batch_norm(x, weight, bias, mean, var, True, 1.0, self.eps, cudnn)
        stats.record(self.index, mean, var)
        return out


class CounterCall(nn.Module):
    """``buf.add_(amount)`` once per micro-batch's own forward (direct) or after the step (combine)."""

    def __init__(self, stats: RunningStats | None, amount: int | float):
        super().__init__()
        self.stats, self.amount = stats, amount

    def forward(self, buf: torch.Tensor) -> torch.Tensor:
        stats = self.stats
        if stats is not None and stats.active is not None and stats.mode == DIRECT:
            buf.add_(self.amount)
        return buf


def install(gm: fx.GraphModule, writes: Sequence[BufferWrite], mode: str) -> RunningStats | None:
    """Replace ``gm``'s batch-norm calls and counters (``writes``: only BATCH_NORM and COUNTER
    kinds) by calls that ``mode`` (DIRECT or COMBINE) governs; their RunningStats, or None when
    ``gm`` writes no buffer."""
    if not writes:
        return None
    kinds = {w.node: w.kind for w in writes}
    counted = {w.node: w.buffer for w in writes if w.kind == COUNTER}
    if any(k not in (BATCH_NORM, COUNTER) for k in kinds.values()):
        raise ValueError(f"install() keeps batch-norm statistics and counters only, not {sorted(set(kinds.values()))}")
    graph = gm.graph
    updates: list[NormUpdate | CountUpdate] = []
    calls: list[BatchNormCall | CounterCall] = []
    offset, dtype, norms = 1, torch.float32, 0
    for node in list(graph.nodes):
        kind = kinds.get(node.name)
        if kind is None:
            continue
        with graph.inserting_before(node):
            if kind == COUNTER:
                buf, amount = node.args[0], node.args[1]
                call: BatchNormCall | CounterCall = CounterCall(None, amount)
                args: tuple = (buf,)
                updates.append(CountUpdate(counted[node.name], amount))
            else:
                args, momentum, eps, cudnn, counter = _norm_call(gm, node)
                mean = gm.get_buffer(str(args[3].target))
                call = BatchNormCall(None, norms, momentum, eps, cudnn)
                updates.append(NormUpdate(str(args[3].target), str(args[4].target), counter, momentum,
                                          mean.numel(), offset))
                offset += 2 * mean.numel()
                dtype = torch.promote_types(torch.promote_types(dtype, mean.dtype),
                                            gm.get_buffer(str(args[4].target)).dtype)
                norms += 1
            name = _free_name(gm, len(calls))
            gm.add_submodule(name, call)
            new = graph.call_module(name, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        calls.append(call)
    gm.recompile()
    stats = RunningStats(gm, mode, updates, offset, dtype)
    for call in calls:
        call.stats = stats
    return stats


def _norm_call(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple, float | None, float, bool | None, str | None]:
    """(x, weight, bias, running_mean, running_var[, counter]) nodes, momentum, eps, cudnn flag and
    counter name of a batch-norm node (``aten.batch_norm``, ``F.batch_norm`` or a module call)."""
    graph = gm.graph
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        assert isinstance(mod, _BatchNorm)

        def attr(local: str) -> fx.Node | None:
            return graph.get_attr(f"{node.target}.{local}") if getattr(mod, local, None) is not None else None
        counter = attr("num_batches_tracked")
        args: tuple = (node.args[0], attr("weight"), attr("bias"), attr("running_mean"), attr("running_var"))
        if counter is not None:
            args += (counter,)
        return (args, mod.momentum, float(mod.eps), None,
                f"{node.target}.num_batches_tracked" if counter is not None else None)

    def arg(i: int, keyword: str, default: Any) -> Any:
        return node.args[i] if i < len(node.args) else node.kwargs.get(keyword, default)
    if node.target is aten.batch_norm.default:
        x, w, b, rm, rv = (arg(i, k, None) for i, k in enumerate(("input", "weight", "bias", "running_mean",
                                                                    "running_var")))
        return (x, w, b, rm, rv), float(arg(6, "momentum", 0.1)), float(arg(7, "eps", 1e-5)), \
            bool(arg(8, "cudnn_enabled", True)), None
    # torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    x, rm, rv, w, b = (arg(i, k, None) for i, k in enumerate(("input", "running_mean", "running_var", "weight",
                                                                "bias")))
    return (x, w, b, rm, rv), float(arg(6, "momentum", 0.1)), float(arg(7, "eps", 1e-5)), None, None


def _free_name(gm: nn.Module, k: int) -> str:
    name = f"{PREFIX}_{k}"
    while hasattr(gm, name):
        k += 1000
        name = f"{PREFIX}_{k}"
    return name


__all__ = ["RunningStats", "BatchNormCall", "CounterCall", "install", "DIRECT", "COMBINE"]
