"""Planning at start: ``launch --profile PROFILE.json --cluster C.json`` instead of ``--plan``.

Rank 0 runs the partitioner once for the job's actual world size (the cluster's first
WORLD_SIZE workers; ``--strategy``, ``--schedule``, ``--micro-batches``, ``--optimizer``,
``--memory-gb``, ``--stages`` as ``hybridpipe partition`` takes them) and broadcasts the plan
(or the one-line reason there is none) to every rank. Under torchrun's elastic restarts the
same flags re-plan for the workers that are left.

Keep ``--micro-batches`` fixed when the world size may change: the partitioner's default (2 per
worker) would change the global batch, and a checkpoint resumes only at the same global batch.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from hybridpipe.errors import UserError, one_line
from hybridpipe.partitioner.cost.cluster import load_cluster
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.planner import Request, partition
from hybridpipe.partitioner.schedule_registry import DEFAULT_SCHEDULE
from hybridpipe.profiles.format import load_profile
from hybridpipe.runtime.config import check_plan_source


def plan_for_world(args: argparse.Namespace, world_size: int) -> Plan:
    """The partitioner's plan of ``args.profile`` for ``world_size`` workers of ``args.cluster``."""
    check_plan_source(args)                     # --profile without --cluster: one line, before any file
    profile = load_profile(args.profile)
    if args.model is not None and args.model != profile.model:
        raise UserError(f"--profile {args.profile} is a profile of {profile.model!r}, not {args.model!r}; "
                        "profile the model you train")
    cluster = load_cluster(args.cluster)
    if world_size > cluster.total_workers:
        raise UserError(f"the job has {world_size} workers but --cluster {args.cluster} describes "
                        f"{cluster.total_workers}; describe the whole cluster")
    req = Request(workers=world_size, strategy=args.strategy, schedule=args.schedule or DEFAULT_SCHEDULE,
                  micro_batches=args.micro_batches, optimizer=args.optimizer or "sgd", memory_gb=args.memory_gb,
                  stages=args.stages)
    return partition(profile, cluster, req).plan


def agree_plan(args: argparse.Namespace, world_size: int) -> tuple[Plan | None, str | None, float]:
    """Collective when torch.distributed is up: rank 0 plans, every rank gets (plan, None, seconds)
    or (None, the one-line problem, seconds)."""
    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list[object] = [None, None]
    if rank == 0:
        try:
            box = [plan_for_world(args, world_size).to_dict(), None]
        except UserError as e:
            box = [None, one_line(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    seconds = time.perf_counter() - t0
    if box[1] is not None:
        return None, str(box[1]), seconds
    return Plan.from_dict(box[0], source="the plan broadcast by rank 0"), None, seconds
