"""Which parameters a plan's stages share (tied weights), from the profile alone (pure).

A profile node owns the parameters it is the first to read (``params``, by their first name in
the model) and lists those an earlier node owns but it reads too (``shared``, by whatever name it
reads them under); ``Profile.tied`` lists the names under which one parameter is registered. A
parameter read in more than one stage becomes a :class:`~hybridpipe.partitioner.plan.TiedGroup`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpipe.partitioner.plan import TiedGroup
from hybridpipe.profiles.format import Profile


def shared_across(params: Sequence[Sequence[str]], shared: Sequence[Sequence[str]], aliases: Sequence[Sequence[str]],
                  ranges: Sequence[tuple[int, int]]) -> list[tuple[str, tuple[int, ...]]]:
    """(parameter, stages) for every parameter read by more than one of the stages ``ranges``.

    ``params[i]``: the names node i owns (first names in the model); ``shared[i]``: the names it
    reads that an earlier node owns; ``aliases``: groups of names of one parameter (first: its name).
    """
    canonical = {name: group[0] for group in aliases for name in group}
    stage_of = {i: s for s, (first, last) in enumerate(ranges) for i in range(first, last + 1)}
    owner = {p: i for i, names in enumerate(params) for p in names}
    readers: dict[str, set[int]] = {}
    for i, names in enumerate(shared):
        for name in names:
            p = canonical.get(name, name)
            if p in owner:
                readers.setdefault(p, {stage_of[owner[p]]}).add(stage_of[i])
    return [(p, tuple(sorted(st))) for p, st in readers.items() if len(st) > 1]


def tied_groups(profile: Profile, ranges: Sequence[tuple[int, int]]) -> list[TiedGroup]:
    """The plan's tied groups for stages ``ranges`` (inclusive node ranges), in model order."""
    size = {name: b for n in profile.nodes for name, b in zip(n.shared, n.shared_bytes, strict=True)}
    canonical = {name: group[0] for group in profile.tied for name in group}
    size.update({canonical.get(k, k): v for k, v in list(size.items())})
    found = shared_across([n.params for n in profile.nodes], [n.shared for n in profile.nodes], profile.tied, ranges)
    return [TiedGroup(param=p, stages=stages, bytes=size.get(p, 0)) for p, stages in found]
