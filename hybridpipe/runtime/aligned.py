"""One model's values on every rank that holds a copy of them, at the job's start.

Each rank builds its own model (an ``nn.Module`` given to the Trainer on every rank may be built
unseeded, or a constant buffer drawn from another RNG than torch's). One process holds one model,
so every copy of a tensor takes the value of the copy on the first rank of the lowest stage that
holds it: a replicated stage's first replica (as DDP broadcasts, and as HybridDataParallel does for
unsharded replicas' weights and buffers), and for a buffer two stages read (a mask, a random
projection, rotary frequencies) or a tied weight, the lowest such stage's (runtime/tied.py's rule).

:func:`align_state` does it for what nothing else aligns: every buffer, and the parameters of
sharded stages (ZeRO-1/2/3 replicas take their owned pieces from their own module, so without it
the whole weights became a patchwork of the replicas' instances and ZeRO-1/2's forwards ran on each
replica's own values until the first update). One all-gather of each rank's digests by name; a
copy that differs from its source's gets the source's bytes by point-to-point messages (none where
every rank built the same model, launch's seeded build).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridpipe.partitioner.plan import Plan

log = logging.getLogger(__name__)


def held_state(plan: Plan, chunks: Sequence[tuple[int, nn.Module]]) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """name -> this rank's copies ``(stage, tensor)``, lowest stage first: every buffer of its
    stages (or model chunks) and every parameter of a sharded one."""
    held: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for index, module in sorted(chunks, key=lambda c: c[0]):
        named = list(module.named_buffers())
        if plan.stages[index].shard != "none":
            named += [(n, p.data) for n, p in module.named_parameters()]
        for name, t in named:
            copies = held.setdefault(name, [])
            if all(t is not c for _, c in copies):
                copies.append((index, t))
    return held


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    c = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{c.dtype}:{tuple(c.shape)};".encode())
    h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def transfers(plan: Plan, every: Sequence[dict[str, tuple[int, str]]]) -> list[tuple[str, int, int]]:
    """``(name, source rank, destination rank)`` of each copy that differs from its source's, in one
    order every rank computes alike from ``every`` (per rank: name -> (its lowest stage holding
    it, the digest of that copy)). The source: the first rank of the lowest stage holding it."""
    lowest: dict[str, int] = {}
    for mine in every:
        for name, (index, _) in mine.items():
            lowest[name] = min(index, lowest.get(name, index))
    out = []
    for name in sorted(lowest):
        src = plan.stages[lowest[name]].ranks[0]
        if name not in every[src]:        # a tied weight of an unsharded lowest stage: runtime/tied.py's
            continue
        want = every[src][name][1]
        out += [(name, src, r) for r, mine in enumerate(every) if r != src and name in mine and mine[name][1] != want]
    return out


def align_state(plan: Plan, rank: int, chunks: Sequence[tuple[int, nn.Module]]) -> int:
    """Give this rank's copies (:func:`held_state`) their source's values (module docstring;
    collective over the default group: every rank calls it once, at the start). Returns how many
    of this rank's tensors changed."""
    held = held_state(plan, chunks)
    mine = {name: (copies[0][0], digest(copies[0][1])) for name, copies in held.items()}
    every: list[dict[str, tuple[int, str]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    changed = 0
    with torch.no_grad():
        for name, src, dst in transfers(plan, every):       # one order on every rank: the pairs meet
            if rank == src:
                dist.send(held[name][0][1].contiguous(), dst)
            elif rank == dst:
                first = held[name][0][1]
                got = torch.empty_like(first, memory_format=torch.contiguous_format)
                dist.recv(got, src)
                for _, t in held[name]:
                    t.copy_(got)
                changed += len(held[name])
        for copies in held.values():                  # two chunks of this rank: one value
            for _, t in copies[1:]:
                if not torch.equal(t, copies[0][1]):
                    t.copy_(copies[0][1])
                    changed += 1
    if changed:
        log.info("rank %d: %d buffers or sharded parameters took the values of their stage's first rank "
                 "(each rank built its own model)", rank, changed)
    return changed
