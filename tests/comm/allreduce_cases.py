"""Worker functions for the multi-process all-reduce tests (spawned by tests/comm/spawn.py).

Every case sums a tensor with one algorithm and compares it with ``torch.distributed.all_reduce``
on a copy of the same input: exactly for integers and for floats holding small integers (exact in
any summation order), to a dtype-dependent tolerance for random floats.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpipe.comm.allreduce import AllReducer, Topology

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def make_input(rank: int, numel: int, dtype: torch.dtype, exact: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, (numel,), generator=g, dtype=torch.int64)
    if exact:
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


def mismatch(got: torch.Tensor, want: torch.Tensor, exact: bool) -> str:
    """'' when ``got`` matches ``want``, else a description of the worst element."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    if exact or not got.is_floating_point():
        bad = (got != want).nonzero()
        return "" if bad.numel() == 0 else f"{bad.numel()} elements differ, first at {bad[0].tolist()}"
    err = (got.double() - want.double()).abs()
    tol = TOLERANCE[got.dtype] * (1 + want.double().abs())
    i = int((err - tol).argmax())
    return "" if bool((err <= tol).all()) else f"element {i}: {got.flatten()[i]} vs {want.flatten()[i]}"


def check_cases(rank: int, world: int, cases: list[tuple], groups: list[list[int]], options: dict) -> list[str]:
    """Run ``cases`` = (algorithm, numel, dtype name, exact) on every group this rank belongs to.

    Returns failures as strings (empty when all pass). ``groups``: lists of global ranks
    (created collectively here, in order); ``options``: AllReducer keyword arguments, with
    ``topology_block`` turned into ``Topology.blocks`` and ``downward: True`` into a second group
    of the same ranks (a connection per direction).
    """
    failures = []
    made = [(ranks, dist.new_group(ranks)) for ranks in groups]
    downs = [dist.new_group(ranks) for ranks in groups] if options.get("downward") else [None] * len(groups)
    for (ranks, group), down in zip(made, downs, strict=True):
        if rank not in ranks:
            continue
        opts = dict(options)
        block = opts.pop("topology_block", None)
        if block:
            opts["topology"] = Topology.blocks(len(ranks), block)
        if opts.pop("downward", False):
            opts["downward"] = down
        reducer = AllReducer(group, **opts)
        for k, (algorithm, numel, dtype_name, exact) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            x = make_input(rank, numel, dtype, exact, seed=k)
            want = x.clone()
            dist.all_reduce(want, group=group)
            ran = reducer(x, algorithm)
            problem = mismatch(x, want, exact)
            if problem:
                failures.append(f"group {ranks} {algorithm}->{ran} numel={numel} {dtype_name} "
                                f"exact={exact}: {problem}")
        reducer.close()
    return failures


def count_cases(rank: int, world: int, algorithms: list[str], numels: list[int], groups: list[list[int]],
                block: int) -> list[str]:
    """Count the elements this rank's executor really sends and receives per all-reduce and compare
    them with the rounds the reducer's cost model prices for the same call. Failures as strings."""
    failures = []
    made = [(ranks, dist.new_group(ranks)) for ranks in groups]
    for ranks, group in made:
        if rank not in ranks:
            continue
        reducer = AllReducer(group, topology=Topology.blocks(len(ranks), block), chunk_bytes=4096)
        counted = {"send": 0, "recv": 0}
        transport = reducer.transport
        real_isend, real_irecv = transport.isend, transport.irecv

        def isend(t, peer, tag, _real=real_isend, _counted=counted):
            _counted["send"] += t.numel()
            return _real(t, peer, tag)

        def irecv(t, peer, tag, _real=real_irecv, _counted=counted):
            _counted["recv"] += t.numel()
            return _real(t, peer, tag)

        transport.isend, transport.irecv = isend, irecv      # the real sends, counted on the way
        me = reducer.costs.ranks[reducer.position]           # this rank in the cost model's numbering
        for algorithm in algorithms:
            for numel in numels:
                counted.update(send=0, recv=0)
                x = torch.ones(numel)
                reducer(x, algorithm)
                nbytes = numel * 4
                variant = {"halving": reducer.costs.halving(nbytes)} if algorithm == "butterfly" else {}
                if algorithm == "torus2d":
                    variant = {"shape": reducer.costs.torus_shape()}
                priced = {"send": 0.0, "recv": 0.0}
                for r in reducer.costs.model.rounds(algorithm, reducer.costs.ranks, **variant):
                    for src, dst, part in r.messages:
                        priced["send"] += r.repeat * part * numel * (src == me)
                        priced["recv"] += r.repeat * part * numel * (dst == me)
                if any(abs(counted[k] - priced[k]) > 1e-6 for k in counted) or not bool((x == len(ranks)).all()):
                    failures.append(f"group {ranks} {algorithm} {variant} numel={numel}: moved {counted}, "
                                    f"priced {priced}")
        reducer.close()
    return failures
