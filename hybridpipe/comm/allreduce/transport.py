"""Point-to-point messages between positions of a process group, with tags that keep
collectives apart.

A message's tag encodes the lane (the thread issuing the collective), the algorithm and the
phase of the algorithm, so two collectives running at once in different lanes never match each
other's messages (gloo matches by sender and tag; within one tag, in posting order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce.schedule import PHASES

ALGORITHM_IDS = {"ring": 1, "butterfly": 2, "hierarchical": 3, "torus2d": 4, "aggregator": 5}
MAX_LANES = 256


def message_tag(lane: int, algorithm: str, phase: str) -> int:
    """A tag unique to (lane, algorithm, phase); < 2**20."""
    if not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane must be in 0..{MAX_LANES - 1}, got {lane}")
    return (lane << 12) | (ALGORITHM_IDS[algorithm] << 5) | PHASES.index(phase)


class GroupTransport:
    """isend/irecv addressed by position in ``group`` (None: the default group).

    ``downward``: a second process group of the same ranks that carries every message sent to a
    lower position. gloo posts a receive by sending a "ready" note to the sender over the one
    connection of the pair, behind whatever data it is itself sending that peer; when two ranks
    exchange (butterfly, aggregator) each side's notes wait behind its own data and the pair
    runs at about half the link rate. With a connection per direction the notes never wait.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, downward: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        self.group = group
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of this process group (ranks {list(self.ranks)})")
        self.position = self.ranks.index(me)
        self.size = len(self.ranks)
        self.backend = str(dist.get_backend(group))
        if downward is not None:
            down = tuple(dist.get_process_group_ranks(downward))
            if down != self.ranks:
                raise ValueError(f"the downward group must have the group's ranks {list(self.ranks)}, got {list(down)}")
        self.downward = downward

    def carrier(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group that carries a message from position ``src`` to position ``dst``."""
        return self.downward if self.downward is not None and src > dst else self.group

    def isend(self, tensor: torch.Tensor, position: int, tag: int) -> dist.Work:
        return _posted(dist.isend(tensor, dst=self.ranks[position], group=self.carrier(self.position, position),
                                  tag=tag))

    def irecv(self, tensor: torch.Tensor, position: int, tag: int) -> dist.Work:
        return _posted(dist.irecv(tensor, src=self.ranks[position], group=self.carrier(position, self.position),
                                  tag=tag))


def _posted(work: dist.Work | None) -> dist.Work:
    """torch returns no work for a rank outside the group (this transport's rank is in it)."""
    if work is None:
        raise RuntimeError("point-to-point op of a rank outside the all-reduce's group")
    return work
