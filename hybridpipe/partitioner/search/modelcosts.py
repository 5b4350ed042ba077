"""A profile reduced to the arrays the partitioner needs: per-node times and bytes, cut sizes.

Positions are the profile's node ids (a topological order). A stage is a range ``i..j`` of
positions; the cut after position ``s`` separates ``0..s`` from ``s+1..``. Every tensor produced
at or before ``s`` and used after ``s`` crosses that cut (skip connections included), whichever
stage uses it, so a tensor that jumps several stages is charged at every cut it passes, as the
pipeline relays it. Its gradient comes back the same way, except for the input batch (the
first node's outputs), which needs none.

Activation memory of a stage i..j, per micro-batch in flight (``stash_bytes``): every storage it
keeps alive between the forward and the backward, counted once: what its nodes save besides the
values they exchange (the profile's ``saved_bytes``), its inputs (the pipeline keeps them for the
backward), its outputs (the roots of the backward), the values made inside it that some node of
it saves, and on the last stage the model's output and what the loss keeps. A value several nodes
save, or a view of another value, is one storage. With recomputation the stage keeps only its
inputs, its outputs and the loss's (``kept_bytes``), and rebuilds the rest of one micro-batch at a
time in the backward (``rerun_bytes``: the rest, plus the outputs its nodes save, which the rerun
makes anew beside the ones kept, less the loss's, which the loss's backward has freed by then).
All three are n x n tables (``stash_table``): what the partitioner's solvers read.

Between a micro-batch's input and weight halves (a zero-bubble schedule's split backward) the stage
holds less (``half_bytes``, the table ``half``): its inputs and outputs still, but of what its
nodes save only what the input half did not free (the profile's ``weight_half_bytes`` /
``weight_half_saves``: the tensors the weight half's formulas read, the graph's it kept), the loss's
freed. A stage whose inputs need no gradient (the first) computes nothing in its input half, and one
holding a node without those fields (not measured, or its input half keeps the whole graph: no weight
formula for it, so the stage's input half keeps every node's) frees nothing: it holds its stash.
On top of either it holds the gradients its input half recorded for the weight half (the profile's
``weight_half_grad_bytes``, summed over its nodes: each intermediate's incoming gradient, the logits'
at an LM head; of a node that depends on none of the stage's inputs, only the gradients of its values
that leave the stage or meet the input path: recorded.py); a stage whose inputs need no gradient records
its outputs' (``cut_grad_bytes``). A
profile without that field (older) gets no table: every stage holds its stash until the weight half.

Transient bytes of a stage i..j (``transient_bytes``, the table ``transient_table``): what it needs for a
moment beyond the activations it holds. Node n's forward or backward allocates ``t[n]`` for a moment
(the profile's ``forward_transient_bytes`` / ``backward_transient_bytes``, the larger: kernels'
temporaries, the gradients flowing through a backward) while the micro-batch it works on holds about
what a stage i..n would keep (``stash_bytes(i, n)``: the later nodes' saved tensors are not made yet, or
already freed by their backward); one node runs at a time, so the stage needs
``max(0, max over n in i..j of (stash_bytes(i, n) + t[n]) - stash_bytes(i, j))`` beyond its stash: the
logits' log-softmax gradients on a language model's last stage, a block's gradients and temporaries
where nothing after it holds more.

Weights of a stage i..j (``weight_bytes``, the table ``weight_table``): the parameters its nodes
own, plus a copy of every tied parameter (an embedding shared with the LM head) that one of its
nodes reads and an earlier stage owns: each stage that reads a tied weight holds it, its gradient
and its optimizer state (pipeline/tied.py), so a head stage pays for the whole embedding.
Frozen parameters (the profile's ``trained_bytes`` below ``param_bytes``) count in the
weights (``held``, their gradients and optimizer state too: an upper bound) but not in ``param_bytes``,
the bytes replicas sync, the optimizer steps and later backwards accumulate into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.partitioner.search.recorded import dependence, recorded_table
from hybridpipe.profiles.format import Profile


@dataclass(frozen=True)
class ModelCosts:
    """Per-node arrays (length N) and cut arrays (length N; entry N-1 is 0: nothing follows)."""

    names: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]     # parameter names each node owns
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    param_bytes: np.ndarray                 # what gets gradients: synced by replicas, stepped (profile's trained_bytes)
    activation_bytes: np.ndarray
    cut_bytes: np.ndarray                   # forward activations crossing the cut after each position
    cut_grad_bytes: np.ndarray              # their gradients coming back
    step_ms: tuple[tuple[str, float], ...] = ()   # (optimizer, ms of one step over all parameters)
    saved_bytes: np.ndarray | None = None   # what autograd keeps per node for the backward (None: unknown)
    # per position: the value that makes a cut right after it infeasible ("" where the cut is free)
    cut_blockers: tuple[str, ...] = ()
    # [i, j]: activation bytes stage i..j keeps per micro-batch, without / with recomputation (None:
    # the profile lists no values; then the nodes' saved (or output) bytes plus the stage's inputs)
    stash: np.ndarray | None = None
    kept: np.ndarray | None = None
    rerun: np.ndarray | None = None
    # per tied parameter: (its bytes, the node that owns it, the other nodes that read it)
    tied: tuple[tuple[float, int, tuple[int, ...]], ...] = ()
    # per node: the most bytes its forward or backward allocates for a moment (None: not measured)
    transient: np.ndarray | None = None
    # [i, j]: what stage i..j holds per micro-batch between its input and weight halves (None: the stash)
    half: np.ndarray | None = None
    # [i, j]: of ``half``, the gradients its input half records for the weight half (None: not measured)
    recorded: np.ndarray | None = None
    # per node: every parameter byte it holds, frozen ones too (None: param_bytes, all trained)
    held_bytes: np.ndarray | None = None

    @property
    def held(self) -> np.ndarray:
        """Every parameter byte of each node (weights a stage holds), trained or not."""
        return self.param_bytes if self.held_bytes is None else self.held_bytes

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
        """Activation bytes one micro-batch leaves on stage i..j for its backward (module docstring)."""
        if self.stash is not None:
            return float(self.stash[i, j])
        per_node = self.saved_bytes if self.saved_bytes is not None else self.activation_bytes
        return float(per_node[i:j + 1].sum() + (self.cut_bytes[i - 1] if i > 0 else 0))

    def half_bytes(self, i: int, j: int) -> float:
        """What one micro-batch holds on stage i..j between its backward's input and weight halves
        (a split schedule; module docstring): the stash where the profile did not measure it."""
        return float(self.half[i, j]) if self.half is not None else self.stash_bytes(i, j)

    def half_table(self) -> np.ndarray:
        """``half_bytes`` as an n x n table, [i, j] for stage i..j (upper triangle)."""
        return self.half if self.half is not None else self.stash_table()[0]

    def recorded_bytes(self, i: int, j: int) -> float:
        """Of :meth:`half_bytes`, the gradients stage i..j's input half records (0: not measured)."""
        return float(self.recorded[i, j]) if self.recorded is not None else 0.0

    def recorded_table(self) -> np.ndarray:
        """[i, j]: of ``half_bytes``, the gradients stage i..j's input half records for its weight half
        (0 where not measured: the stash stands for all of it)."""
        return self.recorded if self.recorded is not None else np.zeros((self.n, self.n))

    def weight_bytes(self, i: int, j: int) -> float:
        """Parameter bytes stage i..j holds: its nodes' own and its copies of tied ones (module docstring)."""
        copies = sum(size for size, owner, readers in self.tied if owner < i and any(i <= r <= j for r in readers))
        return float(self.held[i:j + 1].sum()) + copies

    def weight_table(self) -> np.ndarray:
        """``weight_bytes`` as an n x n table, [i, j] for stage i..j (upper triangle)."""
        p = self.prefix(self.held)
        table = p[None, 1:] - p[:-1, None]
        rows, cols = np.arange(self.n)[:, None], np.arange(self.n)[None, :]
        for size, owner, readers in self.tied:      # stage i..j with owner < i and a reader in i..j: one copy
            reads = np.zeros((self.n, self.n), dtype=bool)
            for r in readers:
                reads |= (rows <= r) & (r <= cols)
            table = table + np.where(reads & (rows > owner), size, 0.0)
        return np.where(cols >= rows, table, 0.0)

    def kept_bytes(self, i: int, j: int) -> float:
        """The same for a recomputing stage: its inputs, outputs and the loss's (module docstring)."""
        if self.kept is not None:
            return float(self.kept[i, j])
        return float(self.cut_bytes[i - 1]) if i > 0 else 0.0

    def rerun_bytes(self, i: int, j: int) -> float:
        """What a recomputing stage i..j rebuilds for one micro-batch beside what it keeps (module docstring)."""
        if self.rerun is not None:
            return float(self.rerun[i, j])
        return self.stash_bytes(i, j) - self.kept_bytes(i, j)

    def stash_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stash, kept, rerun) as n x n tables, [i, j] for stage i..j (upper triangle; module docstring).
        Without the profile's values: the nodes' saved bytes (their outputs where unknown) plus the inputs."""
        if self.stash is not None and self.kept is not None and self.rerun is not None:
            return self.stash, self.kept, self.rerun
        per_node = self.saved_bytes if self.saved_bytes is not None else self.activation_bytes
        a_in = np.concatenate([[0.0], self.cut_bytes[:-1]])
        p = self.prefix(per_node)
        stash, kept = (p[None, 1:] - p[:-1, None]) + a_in[:, None], np.repeat(a_in[:, None], self.n, axis=1)
        return stash, kept, stash - kept

    def transient_bytes(self, i: int, j: int) -> float:
        """What stage i..j needs for a moment beyond its held activations (module docstring)."""
        if self.transient is None:
            return 0.0
        stash = (self.stash if self.stash is not None else self.stash_table()[0])[i, i:j + 1]
        return max(float(np.maximum.accumulate(stash + self.transient[i:j + 1])[-1] - stash[-1]), 0.0)

    def transient_table(self) -> np.ndarray:
        """``transient_bytes`` as an n x n table, [i, j] for stage i..j (upper triangle)."""
        table = np.zeros((self.n, self.n))
        if self.transient is not None:
            stash = self.stash_table()[0]
            for i in range(self.n):
                row = stash[i, i:]
                table[i, i:] = np.maximum(np.maximum.accumulate(row + self.transient[i:]) - row, 0.0)
        return table

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
    tables = stash_tables(profile, saved) if profile.values else (None, None, None)
    half, recorded = half_table(profile, tables[0], cut_grad) if tables[0] is not None else (None, None)
    transient = np.array([max(nd.forward_transient_bytes, nd.backward_transient_bytes) for nd in profile.nodes],
                         dtype=float)
    held = np.array([nd.param_bytes for nd in profile.nodes], dtype=float)
    return ModelCosts(
        names=tuple(nd.name for nd in profile.nodes),
        params=tuple(nd.params for nd in profile.nodes),
        forward_ms=np.array([nd.forward_ms for nd in profile.nodes], dtype=float),
        backward_ms=np.array([nd.backward_ms for nd in profile.nodes], dtype=float),
        param_bytes=np.array([nd.param_bytes if nd.trained_bytes is None else nd.trained_bytes for nd in profile.nodes],
                             dtype=float),
        activation_bytes=np.array([nd.activation_bytes for nd in profile.nodes], dtype=float),
        cut_bytes=cut,
        cut_grad_bytes=cut_grad,
        step_ms=(("sgd", profile.totals.sgd_step_ms), ("adam", profile.totals.adam_step_ms),
                 ("adamw", profile.totals.adam_step_ms)),        # the same element-wise work as adam
        saved_bytes=saved if saved.any() else None,
        cut_blockers=tuple(nd.cut_blocker or "" for nd in profile.nodes),
        stash=tables[0], kept=tables[1], rerun=tables[2], tied=tied_reads(profile),
        transient=transient if transient.any() else None, half=half, recorded=recorded,
        held_bytes=held if any(nd.trained_bytes is not None and nd.trained_bytes != nd.param_bytes
                               for nd in profile.nodes) else None,
    )


def tied_reads(profile: Profile) -> tuple[tuple[float, int, tuple[int, ...]], ...]:
    """Every parameter some node reads that an earlier node owns: (bytes, owner, readers)."""
    owner = {name: nd.id for nd in profile.nodes for name in nd.params}
    found: dict[str, tuple[float, int, list[int]]] = {}
    for nd in profile.nodes:
        for name, size in zip(nd.shared, nd.shared_bytes, strict=False):
            if name in owner:
                found.setdefault(name, (float(size), owner[name], []))[2].append(nd.id)
    return tuple((size, o, tuple(readers)) for size, o, readers in found.values())


def stash_tables(profile: Profile, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stash, kept, rerun) n x n tables from the profile's values (module docstring).

    A value made by node p and read up to node q (views of one storage merged into one value over
    their joint span) is kept by a stage i..j that starts after p and no later than q (an input),
    and by one with i <= p <= j that either sends it on (j < q) or has a node that saves it (any
    j >= p: savers lie in p..q). Each such region is a rectangle of (i, j), summed with a 2-D
    difference table."""
    return _tables(profile, saved, [node.saves for node in profile.nodes], float(profile.loss_saved_bytes))


def half_table(profile: Profile, stash: np.ndarray, cut_grad: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """[i, j]: what stage i..j holds per micro-batch between its input and weight halves (module
    docstring), from the nodes' ``weight_half_bytes`` / ``weight_half_saves`` / ``weight_half_grad_bytes``
    and the values as :func:`stash_tables` counts them (the loss's freed), and of it the recorded
    gradients; None where a node lacks their bytes (a profile made before they were measured, or
    without the split)."""
    nodes = profile.nodes
    if not profile.values or any(nd.weight_half_grad_bytes is None for nd in nodes):
        return None, None
    unknown = np.array([nd.weight_half_bytes is None or nd.weight_half_saves is None for nd in nodes])
    inner = np.array([nd.saved_bytes if u else nd.weight_half_bytes for nd, u in zip(nodes, unknown, strict=True)],
                     dtype=float)
    saves = [nd.saves if u else nd.weight_half_saves or () for nd, u in zip(nodes, unknown, strict=True)]
    kept = _tables(profile, inner, saves, 0.0)[0]
    # a node depending on none of the stage's inputs runs its whole backward in the weight half: it holds
    # all it saved (its block's weight half alone, measured with its inputs needing a gradient, holds less)
    anew: dict[tuple[int, ...], np.ndarray] = {}
    deps = dependence(profile)
    for i, dep in enumerate(deps or ()):
        free = tuple(int(k) for k in np.flatnonzero(~dep[i:]) + i if not unknown[k])
        if free:
            if free not in anew:
                whole_inner, whole_saves = inner.copy(), list(saves)
                for k in free:
                    whole_inner[k], whole_saves[k] = nodes[k].saved_bytes, nodes[k].saves
                anew[free] = _tables(profile, whole_inner, whole_saves, 0.0)[0]
            kept[i] = anew[free][i]
    # no input needs a gradient: the input half computes nothing, the weight half the whole backward;
    # a node without the fields: the stage's input half keeps the graph
    idle = np.concatenate([[True], cut_grad[:-1] == 0])
    p = np.concatenate([[0], np.cumsum(unknown)])
    keeps = (p[None, 1:] - p[:-1, None]) > 0            # [i, j]: a node of i..j lacks them
    kept = np.where(idle[:, None] | keeps, stash, np.minimum(kept, stash))     # what stays of what was held
    wh = np.array([float(nd.weight_half_grad_bytes or 0) for nd in nodes])
    recorded = np.where(idle[:, None], cut_grad[None, :], recorded_table(profile, wh, deps))
    recorded = np.triu(recorded)
    return np.triu(kept) + recorded, recorded


def _tables(profile: Profile, saved: np.ndarray, saves: Sequence[Sequence[str]], loss_saved: float
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`stash_tables` with node n's inner bytes ``saved[n]``, its saved values ``saves[n]`` and
    the loss's ``loss_saved`` bytes."""
    n = len(profile.nodes)
    span: dict[int, list] = {}          # alias -> [producer, last_use, bytes, first saver or None]
    savers: dict[str, int] = {}
    for node, names in zip(profile.nodes, saves, strict=True):
        for name in names:
            savers.setdefault(name, node.id)
    for v in profile.values:
        s = span.setdefault(v.alias, [v.producer, v.last_use, v.bytes, None])
        s[0], s[1] = min(s[0], v.producer), max(s[1], v.last_use)
        if v.name in savers:
            s[3] = savers[v.name] if s[3] is None else min(s[3], savers[v.name])
    stash, kept, anew = np.zeros((n + 1, n + 1)), np.zeros((n + 1, n + 1)), np.zeros((n + 1, n + 1))

    def add(table: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], value: float) -> None:
        (r0, r1), (c0, c1) = rows, cols             # inclusive ranges
        if r0 <= r1 and c0 <= c1:
            table[r0, c0] += value
            table[r0, c1 + 1] -= value
            table[r1 + 1, c0] -= value
            table[r1 + 1, c1 + 1] += value

    for p, q, size, saver in span.values():
        for table in (stash, kept):
            add(table, (p + 1, q), (0, n - 1), size)                 # an input of the stage
        add(kept, (0, p), (p, q - 1), size)                          # an output
        add(stash, (0, p), (p, n - 1) if saver is not None else (p, q - 1), size)
        if saver is not None:                                        # an output the rerun makes again
            add(anew, (0, p), (saver, q - 1), size)
    last = float(profile.nodes[-1].activation_bytes) + loss_saved    # the model's output, the loss's
    for table in (stash, kept):
        add(table, (0, n - 1), (n - 1, n - 1), last)
    add(anew, (0, n - 1), (n - 1, n - 1), -loss_saved)
    stash, kept, anew = (t.cumsum(0).cumsum(1)[:n, :n] for t in (stash, kept, anew))
    p_saved = np.concatenate([[0.0], np.cumsum(saved)])
    stash += p_saved[None, 1:] - p_saved[:-1, None]
    upper = np.triu(np.ones((n, n), dtype=bool))
    rerun = np.maximum(stash - kept + anew, 0.0)
    return np.where(upper, stash, 0.0), np.where(upper, kept, 0.0), np.where(upper, rerun, 0.0)


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
