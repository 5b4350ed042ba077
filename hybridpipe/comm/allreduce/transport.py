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
    """isend/irecv addressed by position in ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
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

    def isend(self, tensor: torch.Tensor, position: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst=self.ranks[position], group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, position: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, src=self.ranks[position], group=self.group, tag=tag)
