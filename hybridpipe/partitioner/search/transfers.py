"""The transfer term of the objective (``objective.py``): a stage's share of its activation traffic.

Per micro-batch, forward activations out and gradients in leave/enter through the stage's links
at level l = max over its ranks p of min over the neighbour's ranks q of level(p, q) (the level a
transfer needs at worst for the nearest peer), shared by the stage's replicas inside each sub-unit
at that level (``busiest_share``: the busiest sub-unit's share of the micro-batches); links are full
duplex, so egress (activations out + gradients in) and ingress are separate. The stage pays
``M * X`` per step, ``X`` = ``transfer_ms``. ``blocktables.py`` is the same for the DP's blocks, vectorised.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.partitioner.cost.costmodel import CostModel


def transfer_level(model: CostModel, ranks: Sequence[int], peers: Sequence[int]) -> int:
    """max over ranks p of min over peers q of level(p, q).

    The innermost level at which p's unit holds some peer, largest over p: per level, which ranks'
    units hold a peer (O((|ranks| + |peers|) levels), not O(|ranks| |peers|) level look-ups)."""
    mine, theirs = np.asarray(ranks, dtype=np.int64), np.asarray(peers, dtype=np.int64)
    level = np.full(len(mine), -1)
    for k in range(len(model.cluster.levels)):
        span = model.cluster.span(k)
        level[(level < 0) & np.isin(mine // span, theirs // span)] = k
    if len(mine) == 0 or len(theirs) == 0 or (level < 0).any():      # empty, or a rank outside the cluster
        return max(min(model.level_between(p, q) for q in peers) for p in ranks)
    return int(level.max())


def busiest_share(model: CostModel, ranks: Sequence[int], level: int) -> float:
    """The largest fraction of ``ranks`` behind one link of ``level``."""
    counts: dict[int, int] = {}
    for r in ranks:
        u = model.sub_unit(r, level)
        counts[u] = counts.get(u, 0) + 1
    return max(counts.values()) / len(ranks)


def transfer_ms(model: CostModel, ranks: Sequence[int], cuts: Sequence[tuple[int, float, float]]) -> float:
    """A stage's activation traffic per micro-batch; ``cuts`` = (level, bytes out, bytes in) per cut."""
    egress: dict[int, float] = {}
    ingress: dict[int, float] = {}
    count: dict[int, int] = {}
    for level, out, inn in cuts:
        egress[level] = egress.get(level, 0.0) + out
        ingress[level] = ingress.get(level, 0.0) + inn
        count[level] = count.get(level, 0) + 1
    worst = 0.0
    for level in count:
        fit = model.link(level)
        load = max(egress[level], ingress[level]) * busiest_share(model, ranks, level)
        worst = max(worst, count[level] * fit.alpha_s + load * fit.beta_s_per_byte)
    return worst * 1e3
