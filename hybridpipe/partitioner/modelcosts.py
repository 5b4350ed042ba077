"""A profile reduced to the arrays the partitioner needs: per-node times and bytes, cut sizes.

Positions are the profile's node ids (a topological order). A stage is a range ``i..j`` of
positions; the cut after position ``s`` separates ``0..s`` from ``s+1..``. Every tensor produced
at or before ``s`` and used after ``s`` crosses that cut (skip connections included), whichever
stage uses it, so a tensor that jumps several stages is charged at every cut it passes, as the
pipeline relays it. Its gradient comes back the same way, except for the input batch (the
first node's outputs), which needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.profiles.format import Profile


@dataclass(frozen=True)
class ModelCosts:
    """Per-node arrays (length N) and cut arrays (length N; entry N-1 is 0: nothing follows)."""

    names: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]     # parameter names each node owns
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    cut_bytes: np.ndarray                   # forward activations crossing the cut after each position
    cut_grad_bytes: np.ndarray              # their gradients coming back
    step_ms: tuple[tuple[str, float], ...] = ()   # (optimizer, ms of one step over all parameters)
    saved_bytes: np.ndarray | None = None   # what autograd keeps per node for the backward (None: unknown)
    # per position: the value that makes a cut right after it infeasible ("" where the cut is free)
    cut_blockers: tuple[str, ...] = ()

    @property
    def cut_ok(self) -> np.ndarray:
        """Bool per position: may a stage end here? (always at the last node)"""
        ok = np.array([not b for b in self.cut_blockers], dtype=bool) if self.cut_blockers else np.ones(self.n, bool)
        ok[-1:] = True
        return ok

    def blocked_cut(self, j: int) -> str | None:
        """The value that blocks the cut after position ``j`` (None where it is free or j is the last)."""
        return (self.cut_blockers[j] or None) if self.cut_blockers and j < self.n - 1 else None

    @property
    def n(self) -> int:
        return len(self.names)

    def slowed(self, factor: float) -> ModelCosts:
        """The same model computing ``factor`` times slower (a refined calibration's compute_slowdown)."""
        if factor == 1.0:
            return self
        return replace(self, forward_ms=self.forward_ms * factor, backward_ms=self.backward_ms * factor)

    def prefix(self, values: np.ndarray) -> np.ndarray:
        """P with P[k] = sum of values[:k] (length N+1)."""
        return np.concatenate([[0.0], np.cumsum(values, dtype=float)])

    def stash_bytes(self, i: int, j: int) -> float:
        """Activations one micro-batch leaves for the backward of stage i..j: what autograd saves in
        its nodes (the profile's ``saved_bytes``; their outputs where it has none) and its inputs."""
        kept = self.saved_bytes if self.saved_bytes is not None else self.activation_bytes
        return float(kept[i:j + 1].sum() + (self.cut_bytes[i - 1] if i > 0 else 0))

    def optimizer_ms(self, optimizer: str) -> np.ndarray:
        """Each node's share of one optimizer step (by parameter bytes); zeros if the profile did not time it."""
        total = float(self.param_bytes.sum())
        step = dict(self.step_ms).get(optimizer, 0.0)
        return self.param_bytes * (step / total) if total > 0 and step > 0 else np.zeros(self.n)

    def input_bytes(self, i: int) -> tuple[float, float]:
        """(activations in, gradients out) per micro-batch for a stage starting at ``i``."""
        return (float(self.cut_bytes[i - 1]), float(self.cut_grad_bytes[i - 1])) if i > 0 else (0.0, 0.0)

    def output_bytes(self, j: int) -> tuple[float, float]:
        """(activations out, gradients in) per micro-batch for a stage ending at ``j``."""
        return float(self.cut_bytes[j]), float(self.cut_grad_bytes[j])


def model_costs(profile: Profile) -> ModelCosts:
    """Extract the arrays from a profile. Cut sizes are the profile's exact ``cut_bytes`` when it has
    them (hybridpipe's profiler), else derived from the edges (hand-made or imported profiles)."""
    exact = any(nd.cut_bytes for nd in profile.nodes)
    if exact:
        cut = np.array([nd.cut_bytes for nd in profile.nodes], dtype=float)
        cut_grad = np.array([nd.cut_grad_bytes for nd in profile.nodes], dtype=float)
    else:
        cut, cut_grad = _edge_cuts(profile)
    saved = np.array([nd.saved_bytes for nd in profile.nodes], dtype=float)
    return ModelCosts(
        names=tuple(nd.name for nd in profile.nodes),
        params=tuple(nd.params for nd in profile.nodes),
        forward_ms=np.array([nd.forward_ms for nd in profile.nodes], dtype=float),
        backward_ms=np.array([nd.backward_ms for nd in profile.nodes], dtype=float),
        param_bytes=np.array([nd.param_bytes for nd in profile.nodes], dtype=float),
        activation_bytes=np.array([nd.activation_bytes for nd in profile.nodes], dtype=float),
        cut_bytes=cut,
        cut_grad_bytes=cut_grad,
        step_ms=(("sgd", profile.totals.sgd_step_ms), ("adam", profile.totals.adam_step_ms)),
        saved_bytes=saved if saved.any() else None,
        cut_blockers=tuple(nd.cut_blocker or "" for nd in profile.nodes),
    )


def _edge_cuts(profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """(cut bytes, their gradients) from the edges: every node output live across a cut is charged
    there; the first node's output, when it is code without parameters (the input batch), needs no gradient."""
    n = len(profile.nodes)
    last_use = list(range(n))
    for src, dst in profile.edges:
        last_use[src] = max(last_use[src], dst)
    act = np.array([nd.activation_bytes for nd in profile.nodes], dtype=float)
    no_grad = np.zeros(n)
    if n and profile.nodes[0].op == "ops" and not profile.nodes[0].params:
        no_grad[0] = act[0]            # the input batch
    diff = np.zeros(n + 1)
    diff_ng = np.zeros(n + 1)
    for u in range(n):
        if last_use[u] > u:            # live on cuts u .. last_use-1
            diff[u] += act[u]
            diff[last_use[u]] -= act[u]
            diff_ng[u] += no_grad[u]
            diff_ng[last_use[u]] -= no_grad[u]
    cut = np.cumsum(diff)[:n]
    cut_ng = np.cumsum(diff_ng)[:n]
    return cut, cut - cut_ng
