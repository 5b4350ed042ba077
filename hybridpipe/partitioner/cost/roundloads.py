"""A collective's priced rounds reduced to the load on each level's busiest link (costmodel.py prices them).

A message between ranks whose innermost common unit is at level l travels on the level-l links of the two
sub-units it leaves and enters (full duplex: the sender's egress, the receiver's ingress); a message to or
from the dedicated aggregator (``collectives.SWITCH``) crosses only its rank's link at the group's top level.
The result depends on the cluster's shape only, not on alpha, beta or the message size S. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.priced import PricedRound


@dataclass(frozen=True)
class RoundLoad:
    """A priced-out round: the busiest link's load (in units of S) per level it touches."""

    level_loads: tuple[tuple[int, float], ...]   # (level, max bytes/S on one link of that level)
    steps: int
    reduce: float
    repeat: int


def round_loads(rounds: Sequence[PricedRound], ranks: Sequence[int], top: int, spans: Sequence[int],
                total_workers: int) -> tuple[RoundLoad, ...]:
    """Sum each link's bytes per round (a message loads its sender's egress and receiver's ingress).

    ``rounds``' endpoints are positions in the sorted ``ranks`` (or SWITCH); ``top``: the outermost
    level the ranks span (where SWITCH messages travel); ``spans``: workers per unit of each level
    (``Cluster.span``); ``total_workers``: the cluster's. All rounds at once: link key = (round, level,
    unit one level below, direction).
    """
    if not rounds:
        return ()
    counts = [len(r.src) for r in rounds]
    which = np.repeat(np.arange(len(rounds)), counts)
    of = np.asarray(list(ranks) + [co.SWITCH], dtype=np.int64)     # position -1 (SWITCH) stays SWITCH
    src = of[np.concatenate([r.src for r in rounds])]
    dst = of[np.concatenate([r.dst for r in rounds])]
    part = np.concatenate([r.share for r in rounds])
    span = np.asarray(spans, dtype=np.int64)
    n_levels = len(span)
    switch = (src == co.SWITCH) | (dst == co.SWITCH)
    shared = (src[:, None] // span[None, :]) == (dst[:, None] // span[None, :])
    level = np.where(switch, top, n_levels - shared.sum(axis=1))
    below = np.concatenate([[1], span])[level]          # workers behind one link of that level
    width = 2 * (total_workers + 1)                      # links per level: (unit, direction)
    keys, loads = [], []
    for end, direction in ((src, 0), (dst, 1)):
        real = end != co.SWITCH
        keys.append(((which * n_levels + level) * width + 2 * (end // below) + direction)[real])
        loads.append(part[real])
    per_link = np.bincount(np.concatenate(keys), weights=np.concatenate(loads),
                           minlength=len(rounds) * n_levels * width)
    per_level = per_link.reshape(len(rounds), n_levels, width).max(axis=2)
    return tuple(RoundLoad(tuple((lv, float(v)) for lv, v in enumerate(row) if v > 0), r.steps, r.reduce,
                           r.repeat) for r, row in zip(rounds, per_level.tolist(), strict=True))
