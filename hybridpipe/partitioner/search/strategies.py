"""The baseline partitions selectable with ``--strategy`` (the optimal one is ``dp.py``).

* ``dp``: one stage holding every node on every worker (pure data parallelism).
* ``uniform``: stages with equal node counts.
* ``params``: stages with balanced parameter bytes (DeepSpeed's ``partition_method="parameters"``).
* ``time``: stages with balanced forward + backward time and no replication (torchgpipe's
  ``balance_by_time``): one stage per worker.
* ``torchtitan``, ``megatron``: transformer layers counted out over the stages as those projects do,
  the embedding and the output weighing a layer each (``layersplit.py``).

``uniform``, ``params``, ``torchtitan`` and ``megatron`` make one stage per worker by default; with
``stages`` S (dividing the worker count) each stage gets W / S replicas, as DeepSpeed's pipeline x data parallel grid
does. Ranks are contiguous blocks in stage order.

None of them cuts where a value that cannot cross a stage boundary would have to (``cuts.py``):
uniform and the layer splits move such a boundary to the nearest free cut, params and time balance
over free cuts only.
"""

from __future__ import annotations

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.cuts import free_ends_mask, nearest_free_ends
from hybridpipe.partitioner.search.layersplit import LAYER_SPLITS, layer_split_sizes
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec

BASELINES = ("dp", "uniform", "params", "time", *LAYER_SPLITS)


def contiguous(sizes: list[int], replicas: list[int]) -> tuple[StageSpec, ...]:
    """Stages of ``sizes`` nodes each on consecutive blocks of ``replicas`` ranks."""
    out, node, rank = [], 0, 0
    for size, r in zip(sizes, replicas, strict=True):
        out.append(StageSpec(node, node + size - 1, tuple(range(rank, rank + r))))
        node, rank = node + size, rank + r
    return tuple(out)


def uniform_sizes(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` groups whose sizes differ by at most one (larger ones first)."""
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def baseline_stages(strategy: str, costs: ModelCosts, workers: int, stages: int | None = None, *,
                    deadline: float | None = None) -> tuple[StageSpec, ...]:
    """The stage list of a baseline strategy (see the module docstring); OutOfTime past ``deadline``."""
    n = costs.n
    if strategy == "dp":
        if stages not in (None, 1):
            raise UserError(f"--strategy dp makes one stage; drop --stages {stages}")
        return contiguous([n], [workers])
    if strategy == "time" and stages not in (None, workers):
        raise UserError(f"--strategy time replicates nothing, so it needs one stage per worker ({workers}); "
                        f"drop --stages or use --strategy uniform/params for {stages} replicated stages")
    parts = stages or workers
    if parts < 1 or workers % parts:
        raise UserError(f"--stages {parts} must divide the {workers} workers (each stage gets the same replicas)")
    if parts > n:
        raise UserError(f"--strategy {strategy} needs {parts} stages but the profile has only {n} nodes; "
                        "use fewer --workers or --stages, or --strategy optimal")
    if strategy in ("uniform", *LAYER_SPLITS):
        wanted = uniform_sizes(n, parts) if strategy == "uniform" else layer_split_sizes(strategy, costs.names, parts)
        ends = list(np.cumsum(wanted)[:-1] - 1)
        found: list[int] | None = np.diff([-1, *nearest_free_ends(costs, ends, strategy), n - 1]).tolist()
    elif strategy in ("params", "time"):
        weights = costs.held if strategy == "params" else costs.forward_ms + costs.backward_ms
        found = balanced_sizes(weights, [1.0] * parts, free_ends_mask(costs), deadline)
    else:
        raise UserError(f"unknown baseline strategy {strategy!r}; choose from {', '.join(BASELINES)}")
    if found is None:
        raise UserError(f"--strategy {strategy} cannot make {parts} stages without splitting a value that cannot "
                        f"cross a stage boundary; use fewer --stages or --strategy optimal")
    return contiguous(found, [workers // parts] * parts)
