"""The gradients a stage's split-backward input half records for its weight half (``ModelCosts.recorded``).

Each block's ``weight_half_grad_bytes`` is measured alone, its inputs needing a gradient where they do in
the model. Inside a stage a block may depend on none of the stage's inputs (BART's decoder embeddings,
beside the encoder output the stage relays): the stage's input half then computes nothing for it and its
weight half runs its whole backward, so only the gradients where its values meet the input path (or leave
the stage) are recorded, not what the block alone records. Which blocks depend on the stage's inputs
follows from the graph's edges and which values need a gradient (the profile's values' ``grad`` flags).
"""

from __future__ import annotations

import numpy as np

from hybridpipe.profiles.format import Profile


def dependence(profile: Profile) -> list[np.ndarray] | None:
    """[i]: for a stage starting at node i, which nodes depend on the stage's inputs (a bool array over
    every node; only k >= i meaningful): a node does if it reads a value needing a gradient from before
    the stage or from a dependent node of it (an edge s -> k carries one if s makes such a value read as
    late as k). None where the profile's values lack their ``grad`` flag (older profiles)."""
    if any(v.grad is None for v in profile.values):
        return None
    preds = _carrying_preds(profile)
    n = len(profile.nodes)
    rows = []
    for i in range(n):
        dep = np.zeros(n, dtype=bool)
        for k in range(i, n):
            dep[k] = any(s < i or dep[s] for s in preds[k])
        rows.append(dep)
    return rows


def _groups(profile: Profile) -> dict[tuple[int, int], list[int]]:
    """(producer, storage) -> [last use, bytes] of the values needing a gradient."""
    groups: dict[tuple[int, int], list[int]] = {}
    for v in profile.values:
        if v.grad and v.producer >= 0:
            group = groups.setdefault((v.producer, v.alias), [v.last_use, v.bytes])
            group[0] = max(group[0], v.last_use)
    return groups


def _carrying(profile: Profile) -> list[tuple[int, int]]:
    """The edges s -> k that carry a value needing a gradient (s makes one read as late as k)."""
    latest: dict[int, int] = {}
    for (s, _), (last, _) in _groups(profile).items():
        latest[s] = max(latest.get(s, -1), last)
    return sorted((s, k) for s, k in profile.edges if latest.get(s, -1) >= k)


def _carrying_preds(profile: Profile) -> list[list[int]]:
    preds: list[list[int]] = [[] for _ in range(len(profile.nodes))]
    for s, k in _carrying(profile):
        preds[k].append(s)
    return preds


def recorded_table(profile: Profile, wh: np.ndarray, deps: list[np.ndarray] | None = None) -> np.ndarray:
    """[i, j]: the gradients stage i..j's input half records for its weight half (modelcosts.py's docstring),
    from each node's measured ``wh`` (its block's alone) and the values' ``grad`` flags. Inside a stage
    a gradient is recorded only where a parameter path meets the input path. A dependent node
    (:func:`dependence`) records its ``wh``. An independent one (BART's decoder embeddings beside the
    relayed encoder output) runs entirely in the weight half: of it only the gradients of its values
    needing one that leave the stage, or that a dependent node of the stage reads, are held. A profile
    whose values lack their ``grad`` flag (older) counts every node's ``wh``. ``deps``: :func:`dependence`'s
    rows where the caller has them."""
    n = len(profile.nodes)
    g = np.concatenate([[0.0], np.cumsum(wh)])
    plain = g[None, 1:] - g[:-1, None]
    deps = deps if deps is not None else dependence(profile)
    if deps is None:
        return plain
    groups = _groups(profile)
    carrying = _carrying(profile)
    table = np.zeros((n, n))
    for i, dep in enumerate(deps):
        if dep[i:].all():
            table[i] = plain[i]
            continue
        feeds = np.full(n, n)               # the first dependent node of the stage reading k
        for s, k in carrying:
            if s >= i and dep[k] and not dep[s]:
                feeds[s] = min(feeds[s], k)
        row = np.zeros(n + 1)               # a difference array over j
        row[i:n] += np.cumsum(np.where(dep[i:], wh[i:], 0.0))
        diff = np.zeros(n + 1)
        for (k, _), (last, size) in groups.items():
            if k >= i and not dep[k]:
                diff[k] += size             # read after j: j in k..last-1
                diff[last] -= size
                if feeds[k] <= last:        # a dependent node of the stage reads it: j >= feeds[k]
                    diff[max(feeds[k], last)] += size
        table[i] = row[:n] + np.cumsum(diff)[:n]
    return table
