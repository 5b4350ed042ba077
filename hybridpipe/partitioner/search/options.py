"""What a plan is searched for: the schedule, micro-batches per step, optimizer, memory per worker,
the all-reduce algorithms allowed, recomputation and sharding (``Options``), checked once here so
every solver and the objective (``objective.py``) can trust them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.sharded import paired_algorithms
from hybridpipe.partitioner.plan import ALGORITHMS, OPTIMIZERS
from hybridpipe.partitioner.schedule_registry import DEFAULT_SCHEDULE, REGISTRY, Schedule
from hybridpipe.partitioner.search.sharding import NONE, Variant, check_shard, runs_with, sharded_variants

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}   # extra copies of the weights an optimizer keeps
RECOMPUTE = ("none", "all", "auto")


@dataclass(frozen=True)
class Options:
    """What the plan is for: schedule, micro-batches per step, optimizer, memory per worker."""

    schedule: Schedule = REGISTRY[DEFAULT_SCHEDULE]     # what it means: schedule_registry.py
    micro_batches: int = 1
    optimizer: str = "sgd"
    memory_bytes: float = math.inf
    algorithms: tuple[str, ...] = ALGORITHMS
    recompute: str = "none"     # none | all | auto (a stage recomputes only when it would not fit otherwise)
    shard: str = "none"         # none | optimizer | gradients | parameters | auto (sharding.py)
    zero3: bool = True          # auto may choose parameters (ZeRO-3); False after its gathers would deadlock

    def __post_init__(self):
        check_shard(self.shard)
        if self.shard not in ("none", "auto") and self.schedule.asynchronous:
            raise UserError(f"--shard {self.shard} needs a flushed schedule ({self.schedule.name} keeps whole weight "
                            "versions for its minibatches in flight); use --schedule 1f1b or --shard none")
        if self.shard not in ("none", "auto") and not paired_algorithms(self.algorithms):
            raise UserError(f"--shard {self.shard} reduce-scatters and all-gathers with ring, butterfly, hierarchical, "
                            "torus2d or native; add one of them to --algorithms")
        if self.recompute not in RECOMPUTE:
            raise UserError(f"unknown --recompute {self.recompute!r}; choose from {', '.join(RECOMPUTE)}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if self.micro_batches < 1:
            raise UserError(f"--micro-batches must be >= 1, got {self.micro_batches}")
        if not self.algorithms or any(a not in ALGORITHMS for a in self.algorithms):
            raise UserError(f"all-reduce algorithms must be among {', '.join(ALGORITHMS)}, got {self.algorithms}")

    def replicas_ok(self, replicas: int) -> bool:
        """Every replica gets micro-batches (r <= M); asynchronous rounds need r to divide M."""
        return bool(self.schedule.replicas_ok(replicas, self.micro_batches))

    def variants(self, replicas: int) -> tuple[Variant, ...]:
        """What a stage of ``replicas`` may shard (``sharding.py``): ``(NONE,)`` for one replica, an asynchronous
        schedule or ``--shard none``; under a level, only that level."""
        if (self.shard == "none" or replicas <= 1 or self.schedule.asynchronous
                or not paired_algorithms(self.algorithms)):
            return (NONE,)
        # auto leaves out what cannot run (sharding.runs_with); a level keeps it, and evaluate refuses the stage
        if self.shard != "auto":
            return self.levels()
        return tuple(v for v in self.levels() if runs_with(v, replicas, self.micro_batches))

    def levels(self) -> tuple[Variant, ...]:
        """What ``--shard`` lets a stage with replicas take, whatever their count (``zero3`` False: no ZeRO-3)."""
        return tuple(v for v in sharded_variants(self.shard) if self.zero3 or v.level != "parameters")
