"""What a sharded replica group's collectives cost: a reduce-scatter and an all-gather instead of an all-reduce.

Sharded replicas (ZeRO, ``Stage.shard``) replace each layer's all-reduce by a reduce-scatter of its
gradients (each replica keeps the sum of its 1/R) and an all-gather of the updated weights (or, with
sharded parameters, of the weights before each use). Every all-reduce of ``collectives.py`` that is
a reduce-scatter followed by an all-gather gives both halves:

* ring / native (NCCL's and gloo's ring): n - 1 rounds of S/n each way: the pair costs exactly the
  all-reduce, each half half of it (latency and bytes alike);
* butterfly with recursive halving (Rabenseifner): halving is the reduce-scatter, doubling the
  all-gather; recursive *doubling* (every round the whole vector) has no such halves: at small sizes,
  where it wins the all-reduce, a sharded group pays the halving variant's 2 log2 p latencies instead
  of log2 p;
* hierarchical (inside, across, inside) and torus2d (rows, columns, rows): the reduce-scatter is the
  inner then the outer reduce-scatter, the all-gather the outer then the inner all-gather;
* aggregator: the root gathers and sums every vector; it is not a reduce-scatter, so sharded groups
  never use it.

So the pair's price on a group is the cheapest of those variants' all-reduce lines (``PAIRED``), and
a reduce-scatter or an all-gather alone costs half the pair. Pure functions of the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpipe.partitioner.cost.costmodel import CostModel, Line

# (algorithm, butterfly halving) whose all-reduce is a reduce-scatter then an all-gather
PAIRED = (("ring", False), ("butterfly", True), ("hierarchical", False), ("torus2d", False), ("native", False))


def paired_algorithms(algorithms: Sequence[str]) -> tuple[str, ...]:
    """The allowed algorithms a sharded group can run (empty: none; then no stage may shard)."""
    return tuple(a for a in algorithms if any(a == p for p, _ in PAIRED))


def pair_lines(model: CostModel, ranks: Sequence[int], algorithms: Sequence[str]) -> list[tuple[str, Line]]:
    """One reduce-scatter + all-gather per allowed paired variant on ``ranks``: its line (seconds = A + B S;
    the cost model's cached all-reduce lines, in ``PAIRED``'s order)."""
    key = tuple(sorted(ranks))
    return [(a, model.line(a, key, halving=h)) for a, h in PAIRED if a in algorithms]


def fastest_pair(nbytes: float, ranks: Sequence[int], model: CostModel,
                 algorithms: Sequence[str]) -> tuple[str, float]:
    """(algorithm, seconds) of the cheapest reduce-scatter + all-gather of ``nbytes`` (ties: the earlier)."""
    if len(ranks) <= 1 or nbytes <= 0:
        return (paired_algorithms(algorithms) or ("",))[0], 0.0
    best: tuple[str, float] | None = None
    for a, ln in pair_lines(model, ranks, algorithms):
        s = ln.seconds(nbytes)
        if best is None or s < best[1]:
            best = (a, s)
    if best is None:
        raise ValueError(f"no reduce-scatter among {', '.join(algorithms)}")
    return best[0], best[1] * float(model.allreduce_factor(nbytes, len(ranks)))


def reduce_scatter_seconds(nbytes: float, ranks: Sequence[int], model: CostModel, algorithms: Sequence[str]) -> float:
    """One reduce-scatter of ``nbytes`` (each replica keeps the sum of 1/R of it): half the pair."""
    return fastest_pair(nbytes, ranks, model, algorithms)[1] / 2


def all_gather_seconds(nbytes: float, ranks: Sequence[int], model: CostModel, algorithms: Sequence[str]) -> float:
    """One all-gather of ``nbytes`` (every replica ends with all of it, from 1/R each): half the pair."""
    return fastest_pair(nbytes, ranks, model, algorithms)[1] / 2
