"""What a checkpoint's manifest says about the plan that wrote it, and how another plan differs
from it (a resume in another plan reshards: runtime/checkpoint.py)."""

from __future__ import annotations

import datetime
from typing import Any

PLAN_SHAPE = ("schedule", "micro_batches", "batch_size", "n_stages", "world_size", "stages")   # a change reshards


def plan_meta(plan: Any, tied: list[list[str]], lineage: str, seconds: float) -> dict:
    """The manifest's fields for ``plan``: model, batch, stage layout, tied names, the lineage of the
    run and the plan itself; ``seconds`` the save took."""
    return {"model": plan.model, "schedule": plan.schedule, "micro_batches": plan.micro_batches,
            "batch_size": plan.batch_size, "global_batch": plan.batch_size * plan.micro_batches,
            "n_stages": len(plan.stages), "world_size": plan.world_size,
            "stages": [{"first_node": s.first_node, "last_node": s.last_node, "ranks": list(s.ranks)}
                       for s in plan.stages],
            "tied": tied,
            "lineage": lineage,
            "plan": plan.to_dict() if hasattr(plan, "to_dict") else {},
            "created": datetime.datetime.now().isoformat(timespec="seconds"), "save_seconds": round(seconds, 3)}


def plan_change(there: dict, here: dict) -> str:
    """How the plan of manifest ``there`` differs from ``here`` (both :func:`plan_meta`'s); "" when the same."""
    for key in PLAN_SHAPE:
        if there.get(key) != here[key]:
            return f"{key}: {short(there.get(key))} there, {short(here[key])} here"
    return ""


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
