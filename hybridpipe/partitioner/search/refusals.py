"""Why a partition request cannot be met, in one line that says what to change (the planner's refusals)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpipe.errors import counted
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, StageSpec
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.sharding import NONE
from hybridpipe.partitioner.search.stagememory import inflight_micro_batches, memory_bytes


def no_fit_message(costs: ModelCosts, workers: int, opts: Options) -> str:
    """Why nothing fits: the hungriest node needs more than a worker has even alone, or the sum does."""
    one = inflight_micro_batches(opts.schedule, 1, 1, 1)
    per_node = [min(memory_bytes(costs, i, i, one, opts, variant=v, replicas=workers)   # sharded over every worker
                    for v in ((NONE,) + opts.variants(workers))) for i in range(costs.n)]
    worst = max(range(costs.n), key=per_node.__getitem__)
    gb = opts.memory_bytes / 1e9
    if per_node[worst] > opts.memory_bytes:
        return (f"no plan fits in {gb:g} GB per worker: node {costs.names[worst]!r} alone needs "
                f"{per_node[worst] / 1e9:.2f} GB (weights, gradients, optimizer state, one micro-batch's "
                "activations" + (", sharded over every worker" if opts.shard != "none" else "")
                + "); raise --memory-gb or use a smaller model or batch")
    if not opts.replicas_ok(1) or costs.n * opts.micro_batches < workers:
        return (f"{workers} workers cannot all get micro-batches: {counted(costs.n, 'node')} x "
                f"{counted(opts.micro_batches, 'micro-batch')} per step; raise --micro-batches or use "
                "fewer --workers")
    other = ("" if opts.schedule.name == "1f1b"
             else ", or use --schedule 1f1b (it keeps fewer micro-batches in flight)")
    return (f"no partition onto {workers} workers fits in {gb:g} GB per worker with "
            f"{counted(opts.micro_batches, 'micro-batch')} ({opts.schedule.name}) and a replica count "
            "per stage that divides into them; raise "
            f"--memory-gb or --micro-batches, add workers or use --recompute auto{other}"
            + ("; or let replicas shard their state (--shard auto)" if opts.shard == "none" else ""))


def memory_message(stages: Sequence[StageSpec], ev: Evaluation, opts: Options, strategy: str) -> str:
    """Why a strategy whose stages are fixed cannot run: replicas without work, or memory."""
    for idx, st in enumerate(stages):
        r, m = len(st.ranks), opts.micro_batches
        if not opts.replicas_ok(r):
            return (f"--strategy {strategy} gives stage {idx} {r} replicas but a step has "
                    f"{counted(m, 'micro-batch')}; "
                    f"use --micro-batches {opts.schedule.replicas_need(r)} "
                    f"(one per replica{' and round' if opts.schedule.asynchronous else ''})")
    idx = next(k for k, e in enumerate(ev.stages) if e.memory_bytes > opts.memory_bytes)
    st, e = stages[idx], ev.stages[idx]
    return (f"--strategy {strategy} does not fit: stage {idx} (nodes {st.first}-{st.last}) needs "
            f"{e.memory_bytes / 1e9:.2f} GB per worker, more than {opts.memory_bytes / 1e9:g} GB; raise --memory-gb, "
            "add workers, try --strategy optimal or --recompute auto"
            + (" or --shard auto" if opts.shard == "none" and len(st.ranks) > 1 else ""))
