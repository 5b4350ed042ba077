"""Plans that launch: a plan's ZeRO-3 weight gathers checked before the plan is used.

A stage that shards its parameters (ZeRO-3) all-gathers its weights with every replica of the stage for
each forward (and, resharding, each backward). With replica counts that differ between stages, some
schedules' lists would tie a replica waiting in a gather to one whose gradient waits on it: launch
refuses such a plan at start (``pipeline/plancheck.check_shards``). The partitioner prices one stage at
a time and cannot see it, so the commands check the plan it chose: under ``--shard auto`` they plan
again without ZeRO-3; under ``--shard parameters`` the plan is refused in one line, as launch would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybridpipe.errors import UserError
from hybridpipe.partitioner.planner import Outcome, Request

ZERO3_NOTE = ("ZeRO-3 left out: the best plan's weight gathers would deadlock between stages of different "
              "replica counts (launch refuses it); this is the best plan without ZeRO-3")


def runnable(plan_for: Callable[[Request], Outcome], req: Request) -> Outcome:
    """``plan_for(req)``, or under ``--shard auto`` the plan without ZeRO-3 where its gathers would deadlock
    (module docstring); a UserError where the request leaves no other way."""
    got = plan_for(req)
    if not any(s.shard == "parameters" and s.replicas > 1 for s in got.plan.stages):
        return got                      # nothing gathers (and partition stays free of torch's import)
    from hybridpipe.pipeline.plancheck import check_shards
    try:
        check_shards(got.plan)
    except UserError:
        if req.shard != "auto" or not req.zero3:
            raise
        again = plan_for(dataclasses.replace(req, zero3=False))      # no ZeRO-3 stage: nothing gathers
        return dataclasses.replace(again, notes=(*again.notes, ZERO3_NOTE))
    return got
