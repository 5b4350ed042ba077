"""The per-rank side of ``overhead.py``: each system's training steps with a CPU clock around every
instruction, and the no-framework baseline of the same stage modules.

A *probe* wraps a callable so that the calling thread's CPU time (``time.thread_time``) spent in
it is added to one kind of instruction: forward, backward, send, recv, data or step. What a step
spends on its thread outside every probe is the framework's dispatch (the schedule's own loop).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import overhead_threads

KINDS = ("forward", "backward", "send", "recv", "data", "step")


class Tally:
    """CPU seconds and call counts per kind of instruction, only while :attr:`on`; :attr:`current`
    is the kind whose probe the step's thread is in (``dispatch`` outside every probe), which
    :class:`Counts` charges Python calls and aten ops to."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.count: dict[str, float] = defaultdict(float)
        self.on = False
        self.current = "dispatch"

    def probe(self, kind: str | Callable[..., tuple[str, float]], fn: Callable,
              counts: Callable[..., float] | None = None) -> Callable:
        """``fn`` timed into ``kind``, counted 1 per call or ``counts(result)``; or into and
        counted as ``kind(*args)`` says: (kind, count)."""
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            k, n = (kind, None) if isinstance(kind, str) else kind(*args)
            outer, self.current = self.current, k
            t0 = time.thread_time()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.current = outer
            if self.on:
                dt = time.thread_time() - t0
                self.cpu[k] += dt
                self.count[k] += n if n is not None else 1.0 if counts is None else counts(out)
            return out
        return timed

    def add(self, kind: str, seconds: float, count: float = 0.0) -> None:
        if self.on:
            self.cpu[kind] += seconds
            self.count[kind] += count


def run_steps(step: Callable[[int], Any], steps: int, warmup: int, tally: Tally, counts: Any = None) -> dict:
    """Run ``step(k)`` for k < ``steps``; the totals over the steps after ``warmup``: per kind CPU
    and counts, the step thread's CPU, the process's CPU (every thread), wall time; and per
    thread label (overhead_threads.py) CPU and wake-ups per step over the steps after ``warmup``
    but the last (a peer that finished may close its links, ending their threads, during it).
    With ``counts`` (overhead_counts.Counts, installed), each step runs under one of its
    counters and the result carries its counts."""
    totals = {"thread_s": 0.0, "process_s": 0.0, "wall_s": 0.0, "steps": 0}
    marks: dict[int, dict] = {}
    for k in range(steps):
        if k in (warmup, steps - 1):
            marks[k] = overhead_threads.snapshot()
        tally.on = k >= warmup
        w0, p0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
        if counts is None:
            step(k)
        else:
            counts.step(step, k)
        t1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        if tally.on:
            totals["thread_s"] += t1 - t0
            totals["process_s"] += p1 - p0
            totals["wall_s"] += w1 - w0
            totals["steps"] += 1
    tally.on = False
    threads = (overhead_threads.delta(marks[warmup], marks[steps - 1], steps - 1 - warmup)
               if len(marks) == 2 else {})
    out = {**totals, "cpu_s": dict(tally.cpu), "count": dict(tally.count), "threads": threads}
    if counts is not None:
        counts.uninstall()
        out["calls"] = counts.result()
    return out


# ---- hybridpipe ------------------------------------------------------------------------------

def ours_rank(rank: int, world: int, plan_path: str, steps: int, warmup: int, count: bool = False) -> dict:
    """hybridpipe's Trainer (channels ``sa``, the engine, the loss watch) on this rank, every
    engine instruction probed by its type; with ``count``, Python calls and aten ops counted
    (overhead_counts.py) instead of a run to time."""
    from benchmarks.torch_side import LR, MOMENTUM, SEED
    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.pipeline import MicroBatches
    from hybridpipe.pipeline import instructions as ins
    from hybridpipe.profiles.data import resolve_dataset
    from hybridpipe.profiles.zoo import resolve_model
    from hybridpipe.runtime.trainer import Trainer

    # (kind, count): the loss is part of the forward, as in torch's forward_one_chunk + loss; a
    # split backward (BackwardInput + BackwardWeight) is one backward
    kind_of = {ins.Forward: ("forward", 1.0), ins.Loss: ("forward", 0.0), ins.Backward: ("backward", 1.0),
               ins.BackwardInput: ("backward", 1.0), ins.BackwardWeight: ("backward", 0.0),
               ins.SendActivations: ("send", 1.0), ins.SendGradients: ("send", 1.0),
               ins.RecvActivations: ("recv", 1.0), ins.RecvGradients: ("recv", 1.0),
               ins.LoadInput: ("data", 1.0), ins.LoadTarget: ("data", 0.0), ins.Step: ("step", 1.0),
               ins.SyncStart: ("step", 0.0), ins.SyncWait: ("step", 0.0)}
    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    data = MicroBatches(resolve_dataset("synthetic", spec, size=steps * plan.micro_batches * plan.batch_size,
                                        seed=SEED), plan.batch_size, plan.micro_batches, targets=spec.loss is not None)
    tally = Tally()
    counts = _counts(tally) if count else None      # before the Trainer starts its threads
    trainer = Trainer(plan.model, plan_path, lr=LR, momentum=MOMENTUM, seed=SEED, data=data, comm_mode="sa",
                      timeout=120)
    engine = trainer.engine
    engine._execute = tally.probe(lambda i, *_: kind_of[type(i)], engine._execute)       # type: ignore[method-assign]
    engine._execute_step_level = tally.probe(lambda i, *_: kind_of[type(i)],             # type: ignore[method-assign]
                                             engine._execute_step_level)
    try:
        return run_steps(lambda k: trainer.train_step(), steps, warmup, tally, counts)
    finally:
        if counts is not None:
            counts.uninstall()
        trainer.close()


def _counts(tally: Tally) -> Any:
    from benchmarks.overhead_counts import Counts

    counts = Counts(tally)
    counts.install()
    return counts


# ---- torch.distributed.pipelining ------------------------------------------------------------

def _ops_kinds(ops: list) -> dict[str, float]:
    import torch.distributed as dist

    sends = sum(1 for op in ops if op.op is dist.isend)
    return {"send": sends / len(ops), "recv": 1 - sends / len(ops)} if ops else {}


def theirs_rank(rank: int, world: int, plan_path: str, steps: int, warmup: int, kind: str,
                count: bool = False) -> dict:
    """torch's schedule class ``kind`` (benchmarks/torch_side.py's job) on this rank: its stage's
    forward/backward chunks, loss, the building, posting and waiting of its p2p ops probed; the
    gradients' 1/M scaling (``perform_reduce_grad``, the schedule's last action) into the step,
    as ours is (its Step, or the backward's seed). ``count`` as in :func:`ours_rank`."""
    from torch.distributed.pipelining import schedules

    from benchmarks.torch_side import build_theirs

    tally = Tally()
    counts = _counts(tally) if count else None
    run = build_theirs(rank, plan_path, steps, kind)
    for pipe in run.pipes:
        pipe.forward_one_chunk = tally.probe("forward", pipe.forward_one_chunk)
        pipe.backward_one_chunk = tally.probe("backward", pipe.backward_one_chunk)
        for name, k in (("get_fwd_send_ops", "send"), ("get_bwd_send_ops", "send"),
                        ("get_fwd_recv_ops", "recv"), ("get_bwd_recv_ops", "recv")):
            setattr(pipe, name, tally.probe(k, getattr(pipe, name), counts=lambda ops: 1.0 if ops else 0.0))
        pipe.perform_reduce_grad = tally.probe("step", pipe.perform_reduce_grad, counts=lambda _: 0)
    run.schedule._maybe_compute_loss = tally.probe("forward", run.schedule._maybe_compute_loss, counts=lambda _: 0)
    if run.optimizer is not None:
        run.optimizer.step = tally.probe("step", run.optimizer.step)
        run.optimizer.zero_grad = tally.probe("step", run.optimizer.zero_grad, counts=lambda _: 0)
    works: dict[int, dict[str, float]] = {}
    batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p

    def batch_p2p(ops, desc=None):     # posting: its CPU (and counts) split between send and recv by the ops
        outer, tally.current = tally.current, "p2p"
        t0 = time.thread_time()
        out = batch(ops, desc)
        dt = time.thread_time() - t0
        tally.current = outer
        share = works[id(out)] = _ops_kinds(ops)
        for k, f in share.items():
            tally.add(k, dt * f)
        if counts is not None:
            counts.split("p2p", share)
        return out

    def wait_p2p(work):
        outer, tally.current = tally.current, "p2p"
        t0 = time.thread_time()
        wait(work)
        dt = time.thread_time() - t0
        tally.current = outer
        share = works.pop(id(work), {"recv": 1.0})
        for k, f in share.items():
            tally.add(k, dt * f)
        if counts is not None:
            counts.split("p2p", share)
    schedules._batch_p2p, schedules._wait_batch_p2p = batch_p2p, wait_p2p
    try:
        load = tally.probe("data", run.batch)
        return run_steps(lambda k: run.step(load(k)), steps, warmup, tally, counts)
    finally:
        if counts is not None:
            counts.uninstall()
        schedules._batch_p2p, schedules._wait_batch_p2p = batch, wait


# ---- the baseline ----------------------------------------------------------------------------

def baseline(plan_path: str, repeats: int) -> list[dict[str, float]]:
    """Per stage, CPU seconds of one micro-batch's forward (with the loss on the last stage) and
    backward as plain PyTorch runs them: the stage's GraphModule called, ``torch.autograd.backward``
    from the loss or from ones; no framework around them. Median of ``repeats`` runs, one thread."""
    import statistics

    from benchmarks.torch_side import SEED
    from hybridpipe.partitioner.plan import load_plan
    from hybridpipe.pipeline import build_stage_index
    from hybridpipe.pipeline.values import unpack
    from hybridpipe.profiles.capture import capture_model
    from hybridpipe.profiles.zoo import resolve_model

    plan = load_plan(plan_path)
    spec = resolve_model(plan.model)
    g = torch.Generator().manual_seed(SEED)
    x = spec.example_input(plan.batch_size, g)
    target = torch.randint(0, spec.num_classes or 2, (plan.batch_size,), generator=g)
    captured = capture_model(spec.build(), x, granularity=plan.granularity, leaf_modules=spec.leaf_modules)
    ranges = [(s.first_node, s.last_node) for s in plan.stages]
    stages = [build_stage_index(captured, ranges, i, loss=spec.loss) for i in range(len(ranges))]
    inputs = stages[0].data_inputs(x)
    out = []
    for st in stages:
        names = st.input_names
        fwd, bwd = [], []
        for _ in range(repeats):
            leaves = {k: t.detach().requires_grad_(not st.is_first and t.is_floating_point())
                      for k, t in inputs.items()}
            values = unpack(leaves, names)
            t0 = time.thread_time()
            result = st.module(*(values[n] for n in names))
            roots = [st.loss(st.captured.rebuild_output(result), target)] if st.is_last else list(result)
            t1 = time.thread_time()
            torch.autograd.backward(roots, None if st.is_last else [torch.ones_like(r) for r in roots])
            t2 = time.thread_time()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        out.append({"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd)})
        if not st.is_last:
            inputs = st.forward(inputs).outputs
            inputs = {k: t.detach() for k, t in inputs.items()}
    return out
