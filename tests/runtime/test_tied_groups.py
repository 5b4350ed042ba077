"""A tied parameter's group (GPT-2's embedding and LM head on the first and last stage) runs on
the default group's gloo device: no event-loop thread of its own polling 100 times a second on
its members for the whole run (benchmarks/RESULTS.md 8g, loopcut), and its all-reduce sums as
a plain gloo group's does."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p.shared_gloo import BACKEND
from hybridpipe.runtime.tied import tied_process_groups
from tests.comm.p2p import scenarios
from tests.comm.p2p.procs import expect_ok, run_ranks

# what tied_process_groups reads of a plan: one rank a stage, a parameter tied between stages 0 and 2
PLAN = SimpleNamespace(stages=[SimpleNamespace(ranks=(r,)) for r in range(3)], tied=[SimpleNamespace(stages=(0, 2))])


def _part(rank: int) -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _tied(rank: int, world: int) -> dict:
    groups = tied_process_groups(PLAN, 30)      # type: ignore[arg-type]
    out: dict = {"loops": scenarios.gloo_loop_threads(), "groups": [list(g) for g in groups]}
    if rank in (0, 2):
        group = groups[(0, 2)]
        flat = _part(rank)
        dist.all_reduce(flat, group=group)
        out["sum_ok"] = torch.equal(flat, _part(0) + _part(2))
        out["backend"] = str(dist.get_backend(group))
    return out


def test_tied_group_shares_the_default_gloo_device():
    values = expect_ok(run_ranks(_tied, 3, timeout=60))
    for rank, r in values.items():
        assert r["groups"] == [[0, 2]], (rank, r)
        assert r["loops"] == 1, (rank, r)          # a plain gloo group: 2 on ranks 0 and 2
        if rank in (0, 2):
            assert r["sum_ok"] and r["backend"] == BACKEND, (rank, r)
