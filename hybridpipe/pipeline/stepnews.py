"""The step's news on the gradient frames: where every rank can learn the loss check's verdict and
the step's loss totals without a collective (pure: instruction lists in, routes out).

Only the rank that runs the step's ``Loss`` instructions knows whether a loss was non-finite and
what the losses sum to. When that rank is unique (the last stage unreplicated) and a chain of
gradient messages leads from after its last ``Loss`` to every other rank before that rank's
``Step``, the news can ride on those messages: the loss rank attaches it to its gradient sends that
follow its last loss, and each rank that received it forwards it on the sends its routes name.

:func:`news_routes` decides this from one step's lists of every rank: rank r (not the loss rank)
takes the news from its *last* ``RecvGradients`` from another rank in the step (its carrier), which
qualifies when the matching ``SendGradients`` on the sender comes after the sender knew: the loss
rank after its last ``Loss``, another rank after its own carrier. The carrier must precede r's
``Step``. Each rank executes its list in order on one thread and a receive blocks until its
message arrived, so a rank whose carrier qualifies holds the complete news before its update.
A list set where any rank's carrier does not qualify (a replicated last stage: several loss ranks;
a replica whose last gradient left the loss rank before the last loss; pipedream, whose updates
do not wait for the step's losses) gets None: the caller keeps its collectives. Messages between
two chunks of one rank (virtual stages) never carry it (they teach the rank nothing new).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpipe.pipeline.instructions import Instruction, Loss, RecvGradients, SendGradients, Step

NEWS = "_hybridpipe_step_news"      # the extra tensor's name in a carrying gradient frame


@dataclass(frozen=True)
class NewsRoute:
    """One rank's part: ``receive`` the ``RecvGradients`` whose frame brings the news (None on the
    loss rank, which makes it), ``sends`` the ``SendGradients`` whose frames carry it on."""

    receive: RecvGradients | None
    sends: frozenset[SendGradients]


def news_routes(programs: Mapping[int, Sequence[Instruction]]) -> dict[int, NewsRoute] | None:
    """Every rank's :class:`NewsRoute` for lists like ``programs`` (rank -> one step's list), or
    None when some rank cannot be proven to learn the news before its update (see the module
    docstring)."""
    loss_ranks = [r for r, p in programs.items() if any(isinstance(i, Loss) for i in p)]
    if len(loss_ranks) != 1:
        return None
    source = loss_ranks[0]
    steps = {r: [k for k, i in enumerate(p) if isinstance(i, Step)] for r, p in programs.items()}
    if any(len(s) != 1 for s in steps.values()):
        return None                     # not one update per step after all the step's work
    losses = [(k, i) for k, i in enumerate(programs[source]) if isinstance(i, Loss)]
    if any(i.micro_batch < 0 for _, i in losses):
        return None                     # a loss of an earlier step's micro-batch (pipedream)
    knows: dict[int, int] = {source: losses[-1][0]}    # rank -> index in its list after which it knows
    carrier: dict[int, tuple[int, RecvGradients]] = {}
    for r, p in programs.items():
        if r == source:
            continue
        received = [(k, i) for k, i in enumerate(p) if isinstance(i, RecvGradients) and i.peer != r]
        if not received or received[-1][0] > steps[r][0]:
            return None
        carrier[r] = received[-1]
    sends: dict[int, set[SendGradients]] = {r: set() for r in programs}
    progress = True
    while progress:
        progress = False
        for r, (k, recv) in carrier.items():
            if r in knows:
                continue
            sender = recv.peer
            if sender not in knows:
                continue
            match = SendGradients(recv.micro_batch, r, recv.stage + 1)
            j = _index(programs[sender], match)
            if j is None or j <= knows[sender]:
                return None             # the message left before its sender knew
            knows[r] = k
            sends[sender].add(match)
            progress = True
    if len(knows) != len(programs) or knows[source] > steps[source][0]:
        return None
    return {r: NewsRoute(carrier[r][1] if r != source else None, frozenset(sends[r])) for r in programs}


def carried_by(program: list[Instruction], route: NewsRoute) -> list[Instruction]:
    """``program`` with the route's own instruction objects in place of the equal ones, so that the
    engine finds its carrying instructions by identity (no comparison per instruction)."""
    ours: dict[Instruction, Instruction] = {i: i for i in route.sends}
    if route.receive is not None:
        ours[route.receive] = route.receive
    return [ours.get(i, i) for i in program]


def _index(program: Sequence[Instruction], instr: Instruction) -> int | None:
    for k, i in enumerate(program):
        if i == instr:
            return k
    return None
