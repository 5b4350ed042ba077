"""Reduce-scatter and all-gather as the halves of the all-reduce descriptions (collectives.py): every
part summed on exactly one owner, the all-gather restoring everything (pure, on every group size), and
the executors running them on real gloo processes equal to torch's own all_reduce / all_gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce.schedule import check, elements, simulate
from hybridpipe.comm.allreduce.transport import GroupTransport
from hybridpipe.comm.sharded import HalvesRunner, plan_halves
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost import shard_halves as sh
from tests.comm.spawn import spawn

CASES = [("ring", n, {}) for n in range(1, 8)] + [("butterfly", n, {}) for n in (2, 4, 8)] + [
    ("torus2d", 6, {"shape": (2, 3)}), ("torus2d", 6, {"shape": (3, 2)}), ("torus2d", 8, {"shape": (2, 4)}),
    ("hierarchical", 6, {"units": [[0, 1, 2], [3, 4, 5]]}), ("hierarchical", 4, {"units": [[0, 1], [2, 3]]})]


@pytest.mark.parametrize("algorithm,n,kw", CASES)
@pytest.mark.parametrize("numel", [1, 7, 64, 101])
def test_halves_sum_each_element_on_one_owner_and_gather_it_to_all(algorithm, n, kw, numel):
    rs, ag = sh.halves(algorithm, n, **kw)
    owners = sh.owners(rs, n)
    bounds = [tuple(co.element_bounds(np.asarray(o), rs.parts, numel).tolist()) for o in owners]
    spans = sorted(b for b in bounds if b[1] > b[0])
    assert spans[0][0] == 0 and spans[-1][1] == numel
    assert all(x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    rng = np.random.default_rng(n * 1000 + numel)
    vectors = [[float(x) for x in rng.integers(-50, 50, numel)] for _ in range(n)]
    total = [sum(v[i] for v in vectors) for i in range(numel)]
    for r in (elements(rs, numel), elements(ag, numel)):
        check(r, n, numel)
    after = simulate(elements(rs, numel), vectors)
    start = []
    for k, (a, b) in enumerate(bounds):
        assert after[k][a:b] == total[a:b], (k, a, b)
        start.append([total[i] if a <= i < b else -1e9 for i in range(numel)])
    assert all(v == total for v in simulate(elements(ag, numel), start))


def test_algorithms_without_halves_shard_with_the_ring():
    assert sh.shard_algorithm("aggregator", 4) == "ring"
    assert sh.shard_algorithm("native", 4) == "ring"
    assert sh.shard_algorithm("butterfly", 6) == "ring"          # the fold has no halves
    assert sh.shard_algorithm("butterfly", 8) == "butterfly"
    assert sh.shard_algorithm("hierarchical", 5, [[0, 1, 2], [3, 4]]) == "ring"
    with pytest.raises(ValueError, match="no reduce-scatter half"):
        sh.halves("aggregator", 4)


def _against_torch(rank: int, world: int) -> list[str]:
    """Each algorithm's halves on a few layouts vs torch's all_reduce (sum) and all_gather."""
    failures = []
    group = dist.new_group()
    runner = HalvesRunner(GroupTransport(group), lane=3)
    native_rs = "available"
    try:                                  # what gloo offers natively (reported, not relied on)
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, torch.ones(2 * world), group=group)
    except (RuntimeError, ValueError) as e:
        native_rs = f"unavailable: {str(e).splitlines()[0][:80]}"
    kws: dict = {"hierarchical": {"units": [[0, 1], [2, 3]]}, "torus2d": {"shape": (2, 2)}}
    for algorithm in ("ring", "butterfly", "hierarchical", "torus2d", "aggregator"):
        for shapes in ([(3,)], [(5, 7), (11,), (2, 2, 2)], [(3_000,), (3,)]):
            gen = torch.Generator().manual_seed(rank)
            mine = [torch.randn(s, generator=gen) for s in shapes]
            want = [t.clone() for t in mine]
            for t in want:
                dist.all_reduce(t, group=group)
            numel = sum(t.numel() for t in mine)
            h = plan_halves(algorithm, world, numel, **kws.get(algorithm, {}))
            runner.run(h.reduce_scatter, mine, h.algorithm)
            flat, ref = torch.cat([t.view(-1) for t in mine]), torch.cat([t.view(-1) for t in want])
            lo, hi = h.owned[rank]
            if not torch.allclose(flat[lo:hi], ref[lo:hi], atol=1e-5):
                failures.append(f"{algorithm} {shapes}: reduce-scatter differs on rank {rank}")
            width = max(b - a for a, b in h.owned)        # torch's all-gather of the owners' ranges (padded)
            pieces = [torch.zeros(width) for _ in range(world)]
            dist.all_gather(pieces, torch.cat([ref[lo:hi], torch.zeros(width - (hi - lo))]), group=group)
            gathered = [torch.full(s, float("nan")) for s in shapes]
            flat_g = torch.cat([t.view(-1) for t in gathered])
            flat_g[lo:hi] = ref[lo:hi]
            offset = 0
            for t in gathered:
                t.view(-1).copy_(flat_g[offset:offset + t.numel()])
                offset += t.numel()
            runner.run(h.all_gather, gathered, h.algorithm)
            expected = torch.zeros(numel)
            for k, piece in enumerate(pieces):
                a, b = h.owned[k]
                expected[a:b] = piece[:b - a]
            if not torch.equal(torch.cat([t.view(-1) for t in gathered]), expected):
                failures.append(f"{algorithm} {shapes}: all-gather differs on rank {rank}")
    return failures + ([f"gloo reduce_scatter {native_rs}"] if rank == 0 and native_rs != "available" else [])


def test_halves_on_gloo_processes_equal_torchs_collectives():
    results = spawn(_against_torch, 4, timeout=120)
    problems = [p for r in results for p in r if not p.startswith("gloo reduce_scatter")]
    assert not problems, problems
    print(*[p for r in results for p in r if p.startswith("gloo")])
