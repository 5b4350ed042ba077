"""The all-reduce rounds of ``collectives.py`` as the cost model prices them.

A cut-through round (the aggregator's way back) overlaps the round before it: the two are priced
as one round with both directions' messages, two latencies and both sums. Consecutive rounds that
move the same amounts between the same endpoints (a ring's n-1 reduce-scatter rounds) are folded
into one with a repeat count, so pricing touches each distinct round once. Pure; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost.collectives import SWITCH, Collective


@dataclass(frozen=True, eq=False)
class PricedRound:
    """A round as the cost model prices it: message i moves ``share[i] * S`` bytes from ``src[i]``
    to ``dst[i]``; at most ``reduce * S`` bytes are summed per rank; ``repeat`` times, ``steps``
    latencies each."""

    src: np.ndarray
    dst: np.ndarray
    share: np.ndarray
    reduce: float = 0.0
    repeat: int = 1
    steps: int = 1

    @property
    def messages(self) -> tuple[tuple[int, int, float], ...]:
        """(src, dst, share) per message."""
        return tuple(zip(self.src.tolist(), self.dst.tolist(), self.share.tolist(), strict=True))


def priced(collective: Collective) -> list[PricedRound]:
    """``collective``'s rounds as the cost model prices them (module docstring); endpoints unchanged."""
    rounds = collective.rounds
    if not rounds:
        return []
    sizes = [r.hi - r.lo for r in rounds]
    # the most any endpoint sums in each round, all rounds at once
    rid = np.repeat(np.arange(len(rounds)), [len(r.src) for r in rounds])
    dst, size = np.concatenate([r.dst for r in rounds]), np.concatenate(sizes)
    flag = np.concatenate([r.reduce for r in rounds])
    width = int(dst.max(initial=0)) + 1 - SWITCH
    summed = np.bincount((rid * width + dst - SWITCH)[flag], weights=size[flag], minlength=len(rounds) * width)
    most = summed.reshape(len(rounds), width).max(axis=1).astype(np.int64).tolist()
    merged: list[list[int]] = []                   # indices of rounds priced as one (cut-through)
    for i, rnd in enumerate(rounds):
        if rnd.cut_through and merged:
            merged[-1].append(i)
        else:
            merged.append([i])
    out: list[PricedRound] = []
    last = None
    for idx in merged:
        if len(idx) == 1:
            src, dst, size = rounds[idx[0]].src, rounds[idx[0]].dst, sizes[idx[0]]
        else:
            src, dst = (np.concatenate([getattr(rounds[i], f) for i in idx]) for f in ("src", "dst"))
            size = np.concatenate([sizes[i] for i in idx])
        reduce = sum(most[i] for i in idx)
        key = (src.tobytes(), dst.tobytes(), size.tobytes(), reduce, len(idx))
        if key == last:
            p = out[-1]
            out[-1] = PricedRound(p.src, p.dst, p.share, p.reduce, p.repeat + 1, p.steps)
            continue
        last = key
        out.append(PricedRound(src, dst, size / collective.parts, reduce / collective.parts, 1, len(idx)))
    return out
