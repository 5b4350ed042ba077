"""Every all-reduce algorithm against torch.distributed.all_reduce, on real gloo processes.

The default run covers every algorithm on a 5-rank world and on non-contiguous subgroups of 3
and 2 ranks (and 1), every dtype, empty to multi-chunk sizes, both executors, two lanes at
once and the dedicated aggregator. ``-m slow`` adds the whole matrix: 1..9 ranks, every
dtype, sizes from 0 to a million elements, two topologies, both executors.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce import AllReducer
from hybridpipe.comm.allreduce.dedicated import AggregatorServer
from tests.comm.allreduce_cases import check_cases, count_cases, make_input, mismatch
from tests.comm.spawn import spawn

ALGOS = ["ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native", "auto"]
# (numel, dtype, exact): empty, one element, odd sizes, many 4 KiB chunks
REPRESENTATIVE = [(0, "float32", False), (1, "int64", True), (7, "bfloat16", True), (1000, "float16", False),
                  (20_011, "float32", False), (20_011, "int64", True)]


def _lanes(rank: int, world: int) -> list[str]:
    """Two threads all-reduce on one group at once, in different lanes: their messages never cross."""
    group = dist.new_group()
    failures = []

    def work(lane: int, algorithm: str) -> None:
        reducer = AllReducer(group, lane=lane, chunk_bytes=4096)
        for k in range(3):
            x = make_input(rank, 5_003, torch.int64, True, seed=lane * 10 + k)
            want = sum(make_input(r, 5_003, torch.int64, True, seed=lane * 10 + k) for r in range(world))
            reducer(x, algorithm)
            if problem := mismatch(x, want, True):
                failures.append(f"lane {lane} {algorithm}: {problem}")

    threads = [threading.Thread(target=work, args=(lane, algo)) for lane, algo in ((1, "ring"), (2, "butterfly"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return failures + [f"lane thread {t.name} still running" for t in threads if t.is_alive()]


def _fast_suite(rank: int, world: int, address: str) -> list[str]:
    cases = [(a, n, d, e) for a in ALGOS for n, d, e in REPRESENTATIVE]
    failures = check_cases(rank, world, cases, [[0, 1, 2, 3, 4], [0, 2, 4], [1, 3], [3]],
                           {"topology_block": 2, "chunk_bytes": 4096})
    rounds = [(a, 3001, "float32", True) for a in ALGOS[:5]]
    failures += check_cases(rank, world, rounds, [[0, 1, 2, 3, 4], [1, 2, 4]],
                            {"pipelined": False, "chunk_bytes": 4096})
    both_ways = [(a, n, d, e) for a in ALGOS for n, d, e in REPRESENTATIVE[3:]]     # a group per direction
    failures += check_cases(rank, world, both_ways, [[0, 1, 2, 3, 4], [0, 2, 4]],
                            {"downward": True, "chunk_bytes": 4096, "topology_block": 2})
    dedicated = [("aggregator", n, d, e) for n, d, e in REPRESENTATIVE]
    failures += check_cases(rank, world, dedicated, [list(range(world))], {"aggregator": address})
    return failures + _lanes(rank, world)


def test_algorithms_match_torch_on_groups_and_subgroups() -> None:
    server = AggregatorServer("127.0.0.1", 0, 5, chunk_bytes=4096, buffers=2, timeout_s=60)
    serving = threading.Thread(target=server.serve, args=(1,), daemon=True)
    serving.start()
    try:
        results = spawn(_fast_suite, 5, f"127.0.0.1:{server.address[1]}", timeout=180)
    finally:
        server.close()
    assert results == [[]] * 5, "\n".join(f for r in results for f in r)


def _reducer_errors(rank: int, world: int) -> list[str]:
    reducer = AllReducer(None)
    out = []
    for call in (lambda: reducer(torch.ones(3), "fastest"),
                 lambda: reducer([torch.ones(3), torch.ones(3, dtype=torch.float64)], "ring"),
                 lambda: reducer(torch.ones(3, dtype=torch.bool), "ring")):
        try:
            call()
            out.append("no error")
        except ValueError as e:
            out.append(str(e).split(";")[0])
    # a non-contiguous tensor is summed in place too
    x = torch.arange(12.0).reshape(3, 4).t()
    reducer(x, "ring")
    out.append(str(torch.equal(x, torch.arange(12.0).reshape(3, 4).t() * world)))
    return out


def test_bad_calls_fail_clearly_and_noncontiguous_tensors_work() -> None:
    results = spawn(_reducer_errors, 2, timeout=60)
    assert results[0] == results[1] == [
        "unknown all-reduce algorithm 'fastest'",
        "tensors of one all-reduce must share dtype and device",
        "all-reduce sums numbers", "True"]


def test_each_rank_moves_the_bytes_the_cost_model_prices() -> None:
    """Real gloo processes, groups of 6, 5, 4 and 3 ranks (hosts of 2): the elements each rank's
    executor sends and receives equal those of the rounds the cost model prices for that call.
    Sizes divide evenly into every algorithm's parts (2520 * 8 elements), small and large (butterfly
    switches variant)."""
    scheduled = ["ring", "butterfly", "hierarchical", "torus2d", "aggregator"]
    groups = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 4, 5], [0, 1, 2, 3], [1, 3, 5]]
    results = spawn(count_cases, 6, scheduled, [2520 * 8, 2520 * 8 * 4], groups, 2, timeout=180)
    assert results == [[]] * 6, "\n".join(f for r in results for f in r)


# ---- the whole matrix ------------------------------------------------------------------------

FULL_SIZES = [0, 1, 2, 3, 5, 17, 1000, 65_537, 1_000_003]
FULL_DTYPES = [("float32", True), ("float32", False), ("float16", False), ("bfloat16", True),
               ("bfloat16", False), ("int64", True)]


@pytest.mark.slow
@pytest.mark.parametrize("world", range(1, 10))
def test_full_matrix(world: int) -> None:
    cases = [(a, n, d, e) for a in ALGOS for n in FULL_SIZES for d, e in FULL_DTYPES
             if n < 100_000 or (d, e) in (("float32", False), ("int64", True))]
    sub = list(range(0, world, 2))                    # non-contiguous ranks
    groups = [list(range(world))] + ([sub] if 1 < len(sub) < world else [])
    # 1 KiB chunks: every size up to 65_537 elements (already 256 chunks of float32, an odd remainder); a
    # million elements there is ~4000 chunks a message, which cost 81% of the test (72 of 89 s on 5 ranks)
    # and takes the large-message path the other two option sets run on it with their default chunks
    for options in ({"topology_block": 2}, {"topology_block": 3, "pipelined": False}, {"chunk_bytes": 1024}):
        mine = [c for c in cases if c[1] < 100_000] if "chunk_bytes" in options else cases
        results = spawn(check_cases, world, mine, groups, options, timeout=900)
        assert results == [[]] * world, "\n".join(f for r in results for f in r)


def _native_list(rank: int, world: int) -> dict:
    """A layer's tensors (mixed shapes, one non-contiguous) all-reduced natively: the sums torch's
    all_reduce gives tensor by tensor, and how many backend calls it took."""
    reducer = AllReducer(dist.new_group())
    shapes = [(64, 32), (32,), (7, 3, 5), (1,), (128,)]
    mine = [torch.randint(-99, 99, s, generator=torch.Generator().manual_seed(10 * rank + i)).float()
            for i, s in enumerate(shapes)]                 # whole numbers: sums exact in any order
    mine[0] = mine[0].t()                                   # non-contiguous
    want = [t.clone() for t in mine]
    for t in want:
        dist.all_reduce(t)
    calls, real = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    dist.all_reduce = counted
    try:
        reducer(mine, "native")
    finally:
        dist.all_reduce = real
    return {"equal": all(torch.equal(a, b) for a, b in zip(mine, want, strict=True)), "calls": len(calls)}


def test_native_all_reduces_a_small_list_in_one_backend_call() -> None:
    """Was one gloo all_reduce per tensor: a Llama layer's 9 tensors paid 9 ring latencies (40-60 ms
    a layer inside the step on 4 emulated hosts, priced 15 ms as one call of their bytes)."""
    for r in spawn(_native_list, 3, timeout=60):
        assert r == {"equal": True, "calls": 1}, r
