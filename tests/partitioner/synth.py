"""Small synthetic profiles and clusters for the partitioner tests (no torch model, no profiler)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec, evaluate
from hybridpipe.partitioner.search.options import Options
from hybridpipe.profiles.format import Profile, ProfileNode


def make_profile(layers: Sequence[tuple[float, float, int, int]], skips: Sequence[tuple[int, int]] = (),
                 model: str = "synthetic", batch_size: int = 8, input_bytes: int = 4096,
                 blockers: Sequence[int] = ()) -> Profile:
    """A chain x -> layer 1 .. layer k -> output in the profile format the profiler writes: ``x`` a
    block of input code (its output, ``input_bytes``, needs no gradient), ``output`` the loss block;
    ``layers`` = (fwd ms, bwd ms, activation bytes, param bytes) per layer; ``skips`` = extra edges
    (src, dst) between node ids (skip connections). Each node's ``cut_bytes`` / ``cut_grad_bytes``
    are exactly what crosses a cut right after it (every output still read later); ``blockers``: node
    ids after which a value that cannot cross a stage boundary is live."""
    specs = [("x", "ops", "ops", 0.0, 0.0, input_bytes, 0)]
    specs += [(f"l{k}", "module", "Linear", f, b, act, par) for k, (f, b, act, par) in enumerate(layers, start=1)]
    specs.append(("output", "ops", "ops", 0.01, 0.01, 0, 0))
    n = len(specs)
    edges = sorted({(k, k + 1) for k in range(n - 1)} | {e for e in skips if e[1] != e[0] + 1})
    last_use = list(range(n))
    for src, dst in edges:
        last_use[src] = max(last_use[src], dst)
    nodes = []
    for i, (name, op, kind, f, b, act, par) in enumerate(specs):
        live = [u for u in range(i + 1) if last_use[u] > i]
        cut = sum(specs[u][5] for u in live)
        grad = sum(specs[u][5] for u in live if u > 0)
        nodes.append(ProfileNode(i, name, op, name, kind, f, b, act, par // 4, par, (f"{name}.weight",) if par else (),
                                 cut_bytes=cut, cut_grad_bytes=grad,
                                 cut_blocker=(f"size{i}" if i else "n") if i in blockers else None))
    return Profile(model, batch_size, (batch_size, 16), "float32", "float32", "cpu", "test", tuple(nodes),
                   tuple(edges))


def flat_cluster(n: int, gbps: float = 1.0, latency_us: float = 0.0, memory_gb: float = 16.0) -> Cluster:
    return Cluster((Level("net", n, gbps, latency_us),), memory_gb)


def two_level(per_host: int, hosts: int, inner_gbps: float = 100.0, outer_gbps: float = 1.0,
              memory_gb: float = 16.0) -> Cluster:
    return Cluster((Level("host", per_host, inner_gbps, 1.0), Level("net", hosts, outer_gbps, 20.0)), memory_gb)


def compositions(total: int, parts: int):
    """Every way to write ``total`` as an ordered sum of ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[k + 1] - bounds[k] for k in range(parts)]


def all_layouts(n_nodes: int, model: CostModel, workers: int, copy_counts: Sequence[int]):
    """Every layout the DP searches: R copies x contiguous node ranges x contiguous rank blocks."""
    for copies in copy_counts:
        wc = workers // copies
        for s in range(1, min(n_nodes, wc) + 1):
            for sizes in compositions(n_nodes, s):
                for blocks in compositions(wc, s):
                    stages, node, rank = [], 0, 0
                    for size, block in zip(sizes, blocks, strict=True):
                        ranks = tuple(sorted(c * wc + q for c in range(copies) for q in range(rank, rank + block)))
                        stages.append(StageSpec(node, node + size - 1, ranks))
                        node, rank = node + size, rank + block
                    yield stages


def brute_force(costs: ModelCosts, model: CostModel, workers: int, opts: Options, copy_counts: Sequence[int]):
    """(best objective, smallest sum of stage terms among plans reaching it) over every layout."""
    scored = []
    for stages in all_layouts(costs.n, model, workers, copy_counts):
        ev = evaluate(costs, model, stages, opts)
        scored.append((ev.objective_ms, sum(e.term_ms for e in ev.stages)))
    best = min(v for v, _ in scored)
    if best == float("inf"):
        return best, best
    return best, min(t for v, t in scored if v <= best * (1 + 1e-9) + 1e-9)
