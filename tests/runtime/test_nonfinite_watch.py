"""The non-finite loss check's collectives on real gloo processes: exact verdicts on every rank, and
a broadcast from the one rank that can raise the flag instead of an all-reduce over the world."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hybridpipe.runtime.nonfinite import NonFiniteWatch
from tests.comm.spawn import spawn

STEPS = 4


@contextlib.contextmanager
def counted(*names: str):
    """Count calls of ``torch.distributed.<name>`` (wrapped, still called)."""
    real = {n: getattr(dist, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def wrap(n):
        def call(*args, **kwargs):
            calls[n] += 1
            return real[n](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n, f in real.items():
            setattr(dist, n, f)


def agree_steps(rank: int, world: int, source: int | None, bad: dict[int, int]) -> dict:
    """Every rank agrees STEPS times; rank r notes a NaN loss at step bad[r] (a finite one otherwise,
    where it computes losses: the source only, or the ranks in ``bad``)."""
    watch = NonFiniteWatch(torch.device("cpu"), skip=True, flushing=True, source=source,
                           decides_alone=source == rank)
    verdicts = []
    with counted("all_reduce", "broadcast") as calls:
        for step in range(STEPS):
            if rank == source or rank in bad:
                watch.note(torch.tensor(float("nan") if bad.get(rank) == step else 1.5))
            verdicts.append(watch.agree())
        for work in watch._pending:               # the source's last broadcast
            work.wait()
    return {"verdicts": verdicts, **calls}


def test_an_unreplicated_last_stage_broadcasts_its_verdict_instead_of_an_all_reduce():
    out = spawn(agree_steps, 4, 3, {3: 2}, timeout=60)
    assert all(r["verdicts"] == [False, False, True, False] for r in out), out
    assert all(r["all_reduce"] == 0 and r["broadcast"] == STEPS for r in out), out


def test_a_replicated_last_stage_keeps_the_all_reduce():
    out = spawn(agree_steps, 4, None, {2: 1, 3: 3}, timeout=60)
    assert all(r["verdicts"] == [False, True, False, True] for r in out), out
    assert all(r["all_reduce"] == STEPS and r["broadcast"] == 0 for r in out), out
