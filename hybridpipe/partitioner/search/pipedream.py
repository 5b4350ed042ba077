"""PipeDream's own partitioner (``--strategy pipedream``), kept as published to reproduce it.

This is the recurrence of PipeDream's ``optimizer_graph_hierarchical.py`` (msr-fiddle/pipedream)
as its README runs it (``--activation_compression_ratio 1``: activation transfers charged), every
worker used, and with its memory constraint on (``--use_memory_constraint``, the worker's memory):

* one stage of nodes i..j on r machines of a level with bandwidth B:
  ``(compute(i..j) + 4 (r-1) params(i..j) / (B r) / machines_per_machine) / r``;
* a split: ``max(A[i][k][m - r'], (compute(k+1..j) + 4 (r'-1) params(k+1..j) / (B r')) / r',
  2 out(k) / (B r' c), 2 out(j) / (B r' c))`` where ``out`` is the activation crossing the cut
  (the last one, into the loss, is not sent) and c the compression ratio (None: no transfer term);
* levels are solved innermost first; a level's best time for i..j on all its machines becomes
  the compute time of i..j for the next level, where a "machine" is a whole inner unit;
* memory: ``ceil((M - r) / r) * (activations + params)`` (single stage) or
  ``ceil((M - m) / r') * (activations + params)`` (split) against the worker's memory;
* splits only where no value that cannot cross a stage boundary would (``cuts.py``; PipeDream has
  no such notion: its profiles never say).

Its plan nests: an outer stage on U units runs the inner level's pipeline for its nodes inside
every one of its units (replicas of an inner stage sit in different units). hybridpipe then
predicts that plan with its own objective, like every other strategy, so they can be compared.
"""

from __future__ import annotations

import math

import numpy as np

from hybridpipe.limits import check_deadline
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec


class _Level:
    """A[i][j][m-1] (best time of nodes i..j on m machines of one level) with the chosen split."""

    def __init__(self, compute: np.ndarray, acts: np.ndarray, params: np.ndarray, machines: int,
                 bytes_per_ms: float, per_machine: int, memory: float, final: bool, cut_ok: np.ndarray,
                 sent: np.ndarray, compression: float | None, deadline: float | None = None):
        n = compute.shape[0]
        self.time = np.full((n, n, machines), np.inf)
        self.split = np.full((n, n, machines), -1, dtype=np.int64)       # k: last node of the prefix
        self.used = np.zeros((n, n, machines), dtype=np.int64)           # machines of the last stage
        for m in range(1, machines + 1):
            dp_comm = 4 * (m - 1) * params / (bytes_per_ms * m) / per_machine
            stash = math.ceil((machines - m) / m) * (acts + params)
            self.time[:, :, m - 1] = np.where(stash <= memory, (compute + dp_comm) / m, np.inf)
            self.used[:, :, m - 1] = m
        self.time[np.tril(np.ones((n, n), dtype=bool), k=-1)] = np.inf
        starts = [0] if final else range(n)
        for i in starts:
            check_deadline(deadline)            # OutOfTime: its caller says so in one line
            for m in range(2, machines + 1):
                for j in range(i + 1, n):
                    ks = np.arange(i, j)                                  # prefix i..k, last stage k+1..j
                    # never where a value cannot cross, nor around the input and the loss: PipeDream's
                    # graph has neither node (they go with the first and the last stage)
                    ks = ks[cut_ok[ks] & (ks >= 1) & (ks <= n - 3)]
                    if ks.size == 0:
                        continue
                    rp = np.arange(1, m)                                  # machines of the last stage
                    last = compute[ks + 1, j][:, None]
                    lp = params[ks + 1, j][:, None]
                    stash = (acts[ks + 1, j][:, None] + lp) * np.ceil((machines - m) / rp)[None, :]
                    stage = (last + 4 * (rp[None, :] - 1) * lp / (bytes_per_ms * rp[None, :])) / rp[None, :]
                    stage = np.where(stash <= memory, stage, np.inf)
                    if compression is not None:                          # the last stage's transfers
                        inbound = 2.0 * sent[ks][:, None] / (bytes_per_ms * rp[None, :]) / compression
                        outbound = 2.0 * sent[j] / (bytes_per_ms * rp[None, :]) / compression
                        stage = np.maximum(stage, np.maximum(inbound, outbound))
                    cand = np.maximum(self.time[i, ks][:, m - rp - 1], stage)
                    flat = int(np.argmin(cand))
                    best = cand.flat[flat]
                    if best < self.time[i, j, m - 1]:
                        k, r = divmod(flat, m - 1)
                        self.time[i, j, m - 1] = best
                        self.split[i, j, m - 1] = ks[k]
                        self.used[i, j, m - 1] = rp[r]

    def stages(self, start: int, end: int, machines: int) -> list[tuple[int, int, int]]:
        """(first, last, machines) of the best plan for nodes start..end on ``machines``, in order."""
        out = []
        j, m = end, machines
        while True:
            k, used = int(self.split[start, j, m - 1]), int(self.used[start, j, m - 1])
            if k < 0:
                out.append((start, j, m))
                break
            out.append((k + 1, j, used))
            j, m = k, m - used
        return out[::-1]


def pipedream_time(costs: ModelCosts, cluster: Cluster, memory_bytes: float | None = None,
                   compression: float | None = 1.0) -> float:
    """The time per stage (ms) of PipeDream's best plan, as its optimizer reports it (inf: no plan)."""
    levels = _levels(costs, cluster, memory_bytes, compression)
    return float(levels[-1].time[0, costs.n - 1, -1])


def pipedream_stages(costs: ModelCosts, cluster: Cluster, memory_bytes: float | None = None,
                     compression: float | None = 1.0, *, deadline: float | None = None
                     ) -> tuple[StageSpec, ...] | None:
    """PipeDream's plan for the whole cluster (None when no plan passes its memory check).

    ``compression``: PipeDream's ``--activation_compression_ratio`` (None: transfers not charged).
    Like PipeDream, the input's bytes do not count (it zeroes the input node) and the activation
    into the loss is not sent. OutOfTime once ``deadline`` (``time.monotonic()``) has passed.
    """
    levels = _levels(costs, cluster, memory_bytes, compression, deadline)
    if not math.isfinite(levels[-1].time[0, costs.n - 1, -1]):
        return None
    out: list[StageSpec] = []
    _place(cluster, levels, len(levels) - 1, 0, costs.n - 1, [0], out)
    return tuple(out)


def _levels(costs: ModelCosts, cluster: Cluster, memory_bytes: float | None, compression: float | None,
            deadline: float | None = None) -> list[_Level]:
    """The recurrence solved level by level, innermost first."""
    n = costs.n
    pc = costs.prefix(costs.forward_ms + costs.backward_ms)
    acts_no_input = costs.activation_bytes.copy()
    acts_no_input[0] = 0.0
    pa, pp = costs.prefix(acts_no_input), costs.prefix(costs.param_bytes)
    sent = costs.cut_bytes.copy()
    sent[max(n - 2, 0):] = 0.0                                 # into the loss (the output node): not sent
    compute = pc[1:][None, :] - pc[:-1][:, None]
    acts = pa[1:][None, :] - pa[:-1][:, None]
    params = pp[1:][None, :] - pp[:-1][:, None]
    memory = cluster.memory_gb * 1e9 if memory_bytes is None else memory_bytes
    levels, per_machine = [], 1
    for idx, lv in enumerate(cluster.levels):
        level = _Level(compute, acts, params, lv.workers, lv.bytes_per_s / 1e3, per_machine, memory,
                       final=idx == len(cluster.levels) - 1, cut_ok=costs.cut_ok, sent=sent,
                       compression=compression, deadline=deadline)
        levels.append(level)
        compute = level.time[:, :, -1].copy()
        per_machine = lv.workers
    return levels


def _place(cluster: Cluster, levels: list[_Level], k: int, first: int, last: int, units: list[int],
           out: list[StageSpec]) -> None:
    """Expand level k's plan for nodes first..last, run identically inside each of ``units``.

    A machine of level k is a unit of level k-1 (``span(k-1)`` workers; a worker at level 0).
    Ranks are ordered replica-major across units, so micro-batch m stays in unit m % len(units).
    """
    size = cluster.span(k - 1) if k > 0 else 1
    offset = 0
    for s, e, m in levels[k].stages(first, last, cluster.levels[k].workers):
        machines = [u + (offset + t) * size for t in range(m) for u in units]
        if k == 0:
            out.append(StageSpec(s, e, tuple(machines)))
        else:
            _place(cluster, levels, k - 1, s, e, machines, out)
        offset += m
