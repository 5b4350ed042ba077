"""CUDA paths (make test-cuda on a GPU machine): CUDA tensors through a gloo group (staged on
the host), every algorithm on an NCCL group (two GPUs; round by round, lower position sends
first), and HybridDataParallel on NCCL against DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.comm.spawn import spawn

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: 2 GPUs")

ALGOS = ["ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native", "auto"]


def _cuda_cases(rank: int, world: int, backend: str) -> list[str]:
    from hybridpipe.comm.allreduce import AllReducer, Topology
    from tests.comm.allreduce_cases import DTYPES, make_input, mismatch

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    group = dist.new_group(backend=backend)
    reducer = AllReducer(group, topology=Topology.blocks(world, 2))
    failures = []
    for k, (algo, numel, dtype, exact) in enumerate(
            (a, n, d, e) for a in ALGOS for n, d, e in [(1, "int64", True), (1001, "bfloat16", True),
                                                        (300_007, "float32", False)]):
        x = make_input(rank, numel, DTYPES[dtype], exact, seed=k).to(device)
        want = x.clone()
        dist.all_reduce(want, group=group)
        reducer(x, algo)
        if problem := mismatch(x.cpu(), want.cpu(), exact):
            failures.append(f"{backend} {algo} {numel} {dtype}: {problem}")
    return failures


def test_cuda_tensors_through_gloo() -> None:
    assert spawn(_cuda_cases, 2, "gloo", timeout=300) == [[], []]


@two_gpus
def test_every_algorithm_on_nccl() -> None:
    world = min(torch.cuda.device_count(), 4)
    assert spawn(_cuda_cases, world, "nccl", timeout=300) == [[]] * world


def _hdp_nccl(rank: int, world: int) -> float:
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from hybridpipe.comm.hybrid_dp import HybridDataParallel
    from tests.comm.hdp_cases import batch, build

    torch.cuda.set_device(rank)
    group_ddp, group_hdp = dist.new_group(backend="nccl"), dist.new_group(backend="nccl")
    base, shape, classes = build("cnn")
    base = base.cuda()
    ddp = DistributedDataParallel(copy.deepcopy(base), process_group=group_ddp)
    hdp = HybridDataParallel(copy.deepcopy(base), group=group_hdp, policy="hybrid")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ddp, hdp)]
    for step in range(3):
        x, y = (t.cuda() for t in batch(rank, step, 0, shape, classes))
        for model, opt in zip((ddp, hdp), opts, strict=True):
            nn.functional.cross_entropy(model(x), y).backward()
            if model is hdp:
                hdp.finish()
            opt.step()
            opt.zero_grad()
    hdp.close()
    pairs = zip(ddp.module.parameters(), hdp.module.parameters(), strict=True)
    return max(float((a - b).abs().max()) for a, b in pairs)


@two_gpus
def test_hdp_on_nccl_matches_ddp() -> None:
    assert max(spawn(_hdp_nccl, 2, timeout=300)) <= 1e-5
