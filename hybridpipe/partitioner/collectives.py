"""Every all-reduce algorithm as rounds of concurrent point-to-point messages.

An algorithm run on a group of global ranks is a list of :class:`Round` s. In one round every
message ``(src, dst, fraction)`` moves ``fraction * S`` bytes at the same time, then each rank
sums at most ``reduce * S`` bytes; the round happens ``repeat`` times and costs ``steps`` message
latencies each time. ``costmodel.py`` prices rounds on the cluster's links, so messages that cross
the same link in one round share its bandwidth. Pure functions over rank tuples; no torch.

Conventions (the comm layer implements the same ones; group ranks are sorted, as
``torch.distributed.new_group`` numbers them; "position" = index in that sorted tuple):

* ring / native: position k sends to k+1 (mod n). Reduce-scatter: n-1 rounds of S/n with a sum;
  all-gather: n-1 rounds of S/n.
* butterfly: p = largest power of two <= n, e = n - p. Fold: for k < e position 2k sends its whole
  vector to 2k+1, which sums it; the p survivors (2k+1 for k < e, then e..n-1 shifted) run
  recursive doubling (small messages: log2 p rounds exchanging all S with the partner at distance
  1, 2, 4, ... in survivor order) or Rabenseifner (large: reduce-scatter by recursive halving,
  nearest partner first, S/2, S/4, ...; then all-gather in reverse order); unfold: 2k+1 sends the
  result back to 2k.
* hierarchical: groups = the ranks' units one level below the outermost level the group spans.
  Equal groups of g: ring reduce-scatter inside each group, g concurrent rings across groups
  (local index t with local index t) on S/g each, ring all-gather inside. Unequal groups: reduce
  to each group's lowest rank (reduce-scatter + gather), a ring across those leaders on S,
  broadcast inside (scatter + all-gather).
* torus2d (R x C): rows are C consecutive positions. Ring reduce-scatter along rows (S/C
  shards), ring all-reduce down each column on its shard, ring all-gather along rows.
* aggregator: the lowest rank (or a dedicated process, ``SWITCH``, attached to the group's
  outermost level) receives every other rank's vector and sends the sum back, cut-through in
  chunks, so the way in and the way back overlap: one round, two latencies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SWITCH = -1  # the dedicated aggregator process: an endpoint outside the workers


Message = tuple[int, int, float]  # (src, dst, fraction of S)


@dataclass(frozen=True)
class Round:
    """Concurrent messages; at most ``reduce * S`` bytes summed per rank; ``repeat`` times."""

    messages: tuple[Message, ...]
    reduce: float = 0.0
    repeat: int = 1
    steps: int = 1


def _ring_pairs(group: Sequence[int], part: float) -> tuple[Message, ...]:
    n = len(group)
    return tuple((group[k], group[(k + 1) % n], part) for k in range(n)) if n > 1 else ()


def ring_rounds(ranks: Sequence[int], scale: float = 1.0) -> list[Round]:
    """Reduce-scatter + all-gather around a ring of ``ranks`` on ``scale * S`` bytes."""
    return rings_rounds([ranks], scale)


def rings_rounds(groups: Sequence[Sequence[int]], scale: float = 1.0) -> list[Round]:
    """Several equal-size rings running at once (one per group), each on ``scale * S`` bytes."""
    n = len(groups[0]) if groups else 0
    if n <= 1:
        return []
    chunk = scale / n
    pairs = tuple(p for g in groups for p in _ring_pairs(g, chunk))
    return [Round(pairs, chunk, repeat=n - 1), Round(pairs, 0.0, repeat=n - 1)]


def _fold(ranks: Sequence[int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """(survivors, fold pairs (sender, receiver)) for the non-power-of-two fold."""
    n = len(ranks)
    p = 1 << (n.bit_length() - 1)
    e = n - p
    pairs = tuple((ranks[2 * k], ranks[2 * k + 1]) for k in range(e))
    survivors = [ranks[2 * k + 1] for k in range(e)] + list(ranks[2 * e:])
    return survivors, pairs


def _exchange(survivors: Sequence[int], distance: int, part: float) -> tuple[Message, ...]:
    return tuple((r, survivors[i ^ distance], part) for i, r in enumerate(survivors))


def butterfly_rounds(ranks: Sequence[int], halving: bool) -> list[Round]:
    """Recursive doubling (``halving=False``) or halving + doubling, with the fold for n != 2^k."""
    n = len(ranks)
    if n <= 1:
        return []
    survivors, fold = _fold(ranks)
    p = len(survivors)
    log_p = p.bit_length() - 1
    rounds = [Round(tuple((a, b, 1.0) for a, b in fold), 1.0)] if fold else []
    if halving:
        for k in range(log_p):
            part = 1.0 / (2 << k)
            rounds.append(Round(_exchange(survivors, 1 << k, part), part))
        for k in reversed(range(log_p)):
            rounds.append(Round(_exchange(survivors, 1 << k, 1.0 / (2 << k))))
    else:
        for k in range(log_p):
            rounds.append(Round(_exchange(survivors, 1 << k, 1.0), 1.0))
    if fold:
        rounds.append(Round(tuple((b, a, 1.0) for a, b in fold)))
    return rounds


def _lockstep(per_group: Sequence[list[Round]]) -> list[Round]:
    """Run several groups' round lists at once: round i merges every group's i-th round.

    Rounds are expanded (``repeat`` unrolled) so groups of different lengths line up, then
    consecutive equal rounds are folded back into one with a repeat count.
    """
    expanded = [[r for r in rounds for _ in range(r.repeat)] for rounds in per_group]
    merged: list[Round] = []
    for i in range(max((len(e) for e in expanded), default=0)):
        here = [e[i] for e in expanded if i < len(e)]
        rnd = Round(tuple(m for r in here for m in r.messages), max(r.reduce for r in here), 1,
                    max(r.steps for r in here))
        last = merged[-1] if merged else None
        if last is not None and (last.messages, last.reduce, last.steps) == (rnd.messages, rnd.reduce, rnd.steps):
            merged[-1] = Round(last.messages, last.reduce, last.repeat + 1, last.steps)
        else:
            merged.append(rnd)
    return merged


def _reduce_to_leader(group: Sequence[int]) -> list[Round]:
    """Reduce-scatter inside the group, then gather every shard to the group's first rank."""
    g = len(group)
    if g <= 1:
        return []
    return ring_rounds(group)[:1] + [Round(tuple((r, group[0], 1.0 / g) for r in group[1:]))]


def _broadcast_from_leader(group: Sequence[int]) -> list[Round]:
    """Scatter from the group's first rank, then all-gather inside the group."""
    g = len(group)
    if g <= 1:
        return []
    return [Round(tuple((group[0], r, 1.0 / g) for r in group[1:]))] + ring_rounds(group)[1:]


def hierarchical_rounds(groups: Sequence[Sequence[int]]) -> list[Round]:
    """Inside each group, across groups, inside again (see the module docstring)."""
    m = len(groups)
    sizes = {len(g) for g in groups}
    if m <= 1:
        return ring_rounds(groups[0]) if groups else []
    if len(sizes) == 1:
        g = sizes.pop()
        inner = rings_rounds(groups)
        across = rings_rounds([[grp[t] for grp in groups] for t in range(g)], 1.0 / g)
        return inner[:1] + across + inner[1:]
    leaders = [grp[0] for grp in groups]
    return (_lockstep([_reduce_to_leader(grp) for grp in groups]) + ring_rounds(leaders)
            + _lockstep([_broadcast_from_leader(grp) for grp in groups]))


def torus_rounds(ranks: Sequence[int], rows: int, cols: int) -> list[Round]:
    """Rows reduce-scatter, columns all-reduce, rows all-gather on an R x C grid (row-major)."""
    if rows * cols != len(ranks):
        raise ValueError(f"torus {rows}x{cols} does not hold {len(ranks)} ranks")
    row_groups = [list(ranks[r * cols:(r + 1) * cols]) for r in range(rows)]
    col_groups = [[ranks[r * cols + c] for r in range(rows)] for c in range(cols)]
    row = rings_rounds(row_groups)
    return row[:1] + rings_rounds(col_groups, 1.0 / cols) + row[1:]


def aggregator_rounds(ranks: Sequence[int], dedicated: bool) -> list[Round]:
    """Everyone to one aggregator and back, cut-through: one round with both directions."""
    n = len(ranks)
    if n <= 1:
        return []
    if dedicated:
        msgs = tuple((r, SWITCH, 1.0) for r in ranks) + tuple((SWITCH, r, 1.0) for r in ranks)
    else:
        agg = ranks[0]
        msgs = tuple((r, agg, 1.0) for r in ranks[1:]) + tuple((agg, r, 1.0) for r in ranks[1:])
    return [Round(msgs, float(n - 1), steps=2)]


def torus_shapes(n: int) -> list[tuple[int, int]]:
    """Every factorisation rows x cols of n."""
    return [(n // c, c) for c in range(1, n + 1) if n % c == 0]


def torus_shape(n: int, inner: int) -> tuple[int, int]:
    """Default rows x cols: rows = inner-level groups of ``inner`` when they tile n, else the squarest."""
    if 1 < inner < n and n % inner == 0:
        return n // inner, inner
    cols = max(c for c in range(1, math.isqrt(n) + 1) if n % c == 0)
    return n // cols, cols

