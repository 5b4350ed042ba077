"""Python calls, C calls and aten ops per send and per receive on one rank: hybridpipe's channels
vs torch's isend / irecv path. Counts, unlike overhead.py's timings, do not depend on the load.

    python benchmarks/p2p_calls.py                          # 2 gloo ranks on loopback, sa, cases a b c
    python benchmarks/p2p_calls.py --modes sa,sra,per-tensor --frames 96 --detail

Rank 0 sends ``--frames`` messages per case to rank 1 under keys that repeat over 8 micro-batches
as the engine's do (``a/0`` ... ``a/7``), after ``--warmup`` messages (metadata announced, buffers
made). Cases: (a) one 2 x 8 float32 tensor that requires grad (overhead.py's activation), (b) a
2 x 8 float32 and an 8-element int64 tensor, (c) one 4 x 128 x 256 float32 tensor (512 KiB).
Counted on the calling thread around each call, in separate passes: Python function calls
(``sys.setprofile`` "call" events, per source file) and calls of C built-ins ("c_call"; calls made
by this script's own code are left out), then the aten ops the call dispatches (a
``TorchDispatchMode``), then its thread CPU (``time.thread_time_ns``; load-dependent, a median).
Rank 1 counts its ``Channels.recv`` (the frame it receives itself or the receive thread hands over) and, per
frame, the link's own threads (``threading.setprofile``; their aten ops through a wrapper of
``FrameReceiver.receive``). (The process's CPU per message is not reported: in this tight loop
gloo's event-loop thread spins while a receive waits, on both sides, and it swamps the rest.)
Torch's side does per message what its pipelining stage and
schedules do: per tensor ``to_local_if_dtensor(t, detach=True)`` and a ``P2POp``, then
``_batch_p2p`` and ``_wait_batch_p2p`` (a send waits for its previous message's works, as our
lazy sends do; a receive waits for its own, into buffers allocated once per micro-batch as
torch's stages allocate theirs); its stage's other bookkeeping (debug logging, peer lookup) is
not counted, so torch's numbers are a lower bound. Results: ``benchmarks/results/p2p_calls[_TAG].json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import machine, result_paths, write_results  # noqa: E402
from hybridpipe.comm.local import describe_failures, run_local  # noqa: E402

CASES = ("a", "b", "c")
MICRO_BATCHES = 8
_HERE = str(Path(__file__).resolve())


def message(case: str, m: int) -> dict[str, torch.Tensor]:
    """Case ``case``'s message for micro-batch ``m`` (fresh values each micro-batch)."""
    g = torch.Generator().manual_seed(m)
    if case == "a":
        return {"x": torch.randn(2, 8, generator=g).requires_grad_()}
    if case == "b":
        return {"x": torch.randn(2, 8, generator=g), "n": torch.arange(8, dtype=torch.int64) + m}
    return {"x": torch.randn(4, 128, 256, generator=g)}


def source(path: str) -> str:
    """A short name for the source file of a counted call."""
    p = path.replace("\\", "/")
    for mark in ("/hybridpipe/", "/torch/distributed/", "/torch/"):
        if mark in p:
            rest = p.split(mark, 1)[1].removesuffix(".py")
            return mark.strip("/").replace("/", ".") + ":" + rest if mark != "/hybridpipe/" else rest
    return p.rsplit("/", 1)[-1].removesuffix(".py")


class Calls:
    """A profile function: Python calls per source (and per function) and C calls, while ``on``;
    what this script's own code does is left out."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.py: Counter[str] = Counter()
        self.fn: Counter[str] = Counter()
        self.c = 0

    def __call__(self, frame, event: str, arg) -> None:
        if not self.on or frame.f_code.co_filename == _HERE:
            return
        if event == "call":
            src = source(frame.f_code.co_filename)
            self.py[src] += 1
            self.fn[f"{src}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            self.c += 1
            self.fn[f"C:{getattr(arg, '__qualname__', repr(arg))}"] += 1


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while ``on`` (a mode is per thread: enter it where counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Threads:
    """Counts in the p2p threads (``threading.setprofile``, set before the channels open): calls
    in every thread named ``p2p-*`` while ``calls.on``; aten ops in ``FrameReceiver.receive``
    calls that started while ``ops.on`` (so the frame whose receive was already waiting when
    counting began is not counted)."""

    def __init__(self) -> None:
        self.calls = Calls(on=False)
        self.ops = Ops()
        self.ops.on = False
        threading.setprofile(self._profile)

    def _profile(self, frame, event: str, arg) -> None:
        if threading.current_thread().name.startswith("p2p-"):
            self.calls(frame, event, arg)

    def wrap_receive(self) -> Callable[[], None]:
        from hybridpipe.comm.p2p.frames import FrameReceiver
        orig = FrameReceiver.receive
        ops = self.ops

        def receive(end, *args, **kwargs):
            if not ops.on or not threading.current_thread().name.startswith("p2p-"):
                return orig(end, *args, **kwargs)
            with Ops() as mode:
                try:
                    return orig(end, *args, **kwargs)
                finally:
                    if ops.on:
                        ops.ops.update(mode.ops)
        FrameReceiver.receive = receive                     # type: ignore[method-assign]
        return lambda: setattr(FrameReceiver, "receive", orig)


def measure(call: Callable[[int], object], frames: int, start: int, sync: Callable[[], None],
            threads: Threads | None, settle: Callable[[], None]) -> dict:
    """Per call of ``call(i)``, i from ``start``: Python calls, C calls, aten ops, thread CPU; and
    per frame what the p2p threads did (``threads``). ``sync`` lines the ranks up before each pass."""
    calls, ops, cpu = Calls(), Ops(), []
    th_calls = th_ops = None
    for what in ("calls", "ops", "cpu"):
        settle()
        if threads is not None:
            getattr(threads, what if what != "cpu" else "calls").on = what != "cpu"
        sync()
        for i in range(start, start + frames):
            if what == "calls":
                sys.setprofile(calls)
                call(i)
                sys.setprofile(None)
            elif what == "ops":
                with ops:
                    call(i)
            else:
                t0 = time.thread_time_ns()
                call(i)
                cpu.append((time.thread_time_ns() - t0) / 1e3)
        start += frames
        settle()
        if threads is not None:
            if what == "calls":
                threads.calls.on = False
                th_calls = (Counter(threads.calls.py), threads.calls.c)
                threads.calls.py.clear()
                threads.calls.c = 0
            elif what == "ops":
                threads.ops.on = False
                th_ops = Counter(threads.ops.ops)
                threads.ops.ops.clear()
    out = {"python_calls": sum(calls.py.values()) / frames, "c_calls": calls.c / frames,
           "aten_ops": sum(ops.ops.values()) / frames,
           "python_calls_by_source": {k: v / frames for k, v in calls.py.most_common()},
           "aten_ops_by_name": {k: v / frames for k, v in ops.ops.most_common()},
           "top_calls": {k: v / frames for k, v in calls.fn.most_common(40)},
           "thread_cpu_us_median": statistics.median(cpu), "next": start}
    if th_calls is not None and th_ops is not None and sum(th_calls[0].values()):
        out["threads_per_frame"] = {
            "python_calls": sum(th_calls[0].values()) / frames, "c_calls": th_calls[1] / frames,
            "aten_ops": sum(th_ops.values()) / max(frames - 1, 1),
            "python_calls_by_source": {k: v / frames for k, v in th_calls[0].most_common()},
            "aten_ops_by_name": {k: v / max(frames - 1, 1) for k, v in th_ops.most_common()}}
    return out


def ours_rank(rank: int, world: int, modes: list[str], cases: list[str], frames: int, warmup: int) -> dict:
    """Rank 0 sends, rank 1 receives each case on channels of each mode; this rank's counts."""
    threads = Threads()
    unwrap = threads.wrap_receive()
    try:
        return {f"ours-{mode}-{case}": _ours_case(rank, mode, case, frames, warmup, threads)
                for mode in modes for case in cases}
    finally:
        unwrap()
        threading.setprofile(None)


def _ours_case(rank: int, mode: str, case: str, frames: int, warmup: int, threads: Threads) -> dict:
    from hybridpipe.comm.p2p import open_channels

    keys = [f"{case}/{m}" for m in range(MICRO_BATCHES)]
    msgs = [message(case, m) for m in range(MICRO_BATCHES)]
    order = None
    if mode == "sra":
        order = {1 - rank: [("send" if rank == 0 else "recv", k) for k in keys]}
    with open_channels([(0, 1)], mode=mode, timeout=60, order=order) as ch:
        def call(i: int) -> None:
            if rank == 0:
                ch.send(1, keys[i % MICRO_BATCHES], msgs[i % MICRO_BATCHES])
            else:
                ch.recv(0, keys[i % MICRO_BATCHES])

        def settle() -> None:
            ch.flush()
            time.sleep(0.3)     # the receive threads back in their waits
        for i in range(warmup):
            call(i)
        settle()
        res = measure(call, frames, warmup, dist.barrier, threads, settle)
        ch.flush()
        dist.barrier()
    return res


def torch_rank(rank: int, world: int, cases: list[str], frames: int, warmup: int) -> dict:
    """The same messages the way torch's pipelining stage and schedules post them."""
    return {f"torch-{case}": _torch_case(rank, case, frames, warmup) for case in cases}


def _torch_case(rank: int, case: str, frames: int, warmup: int) -> dict:
    from torch.distributed.pipelining._utils import to_local_if_dtensor
    from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

    msgs = [message(case, m) for m in range(MICRO_BATCHES)]
    bufs = [[torch.empty_like(t) for t in msg.values()] for msg in msgs]
    pending: list[list] = []

    def call(i: int) -> None:
        if rank == 0:
            ops = [dist.P2POp(dist.isend, to_local_if_dtensor(t, detach=True), 1)
                   for t in msgs[i % MICRO_BATCHES].values()]
            pending.append(_batch_p2p(ops))
            if len(pending) > 1:
                _wait_batch_p2p(pending.pop(0))
        else:
            _wait_batch_p2p(_batch_p2p([dist.P2POp(dist.irecv, b, 0) for b in bufs[i % MICRO_BATCHES]]))

    def settle() -> None:
        while pending:
            _wait_batch_p2p(pending.pop(0))
        time.sleep(0.3)
    for i in range(warmup):
        call(i)
    settle()
    res = measure(call, frames, warmup, dist.barrier, None, settle)
    dist.barrier()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sa", help="comma-separated channel modes: sa, sra, per-tensor")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--detail", action="store_true", help="print the most frequent calls per send / receive")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    cases = [c for c in a.cases.split(",") if c]
    if bad := [c for c in cases if c not in CASES]:
        raise SystemExit(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
    runs = [("ours", run_local(ours_rank, 2, modes, cases, a.frames, a.warmup, timeout_s=600))]
    if not a.no_torch:
        runs.append(("torch", run_local(torch_rank, 2, cases, a.frames, a.warmup, timeout_s=600)))
    table: dict[str, dict] = {}
    for who, outcomes in runs:
        if problems := describe_failures(outcomes):
            raise SystemExit(f"{who}: {problems}")
        send, recv = (o.value for o in sorted(outcomes, key=lambda o: o.rank))
        for name in send:
            table[name] = {"send": send[name], "recv": recv[name]}
    for name, row in table.items():
        for side in ("send", "recv"):
            r = row[side]
            line = (f"{name:>20} {side}: python {r['python_calls']:5.1f}  C {r['c_calls']:5.1f}  "
                    f"aten {r['aten_ops']:4.1f}  cpu {r['thread_cpu_us_median']:6.1f} us")
            if th := r.get("threads_per_frame"):
                line += (f"  | p2p threads per frame: python {th['python_calls']:5.1f}  C {th['c_calls']:5.1f}"
                         f"  aten {th['aten_ops']:4.1f}")
            print(line)
            if a.detail:
                print("      by source: " + ", ".join(f"{k} {v:g}" for k, v in r["python_calls_by_source"].items()))
                print("      aten: " + ", ".join(f"{k} {v:g}" for k, v in r["aten_ops_by_name"].items()))
                print("      top: " + ", ".join(f"{k} {v:g}" for k, v in r["top_calls"].items()))
                if th:
                    print("      threads by source: " + ", ".join(
                        f"{k} {v:g}" for k, v in th["python_calls_by_source"].items()))
                    print("      threads aten: " + ", ".join(f"{k} {v:g}" for k, v in th["aten_ops_by_name"].items()))
    path, _ = result_paths("p2p_calls" + (f"_{a.tag}" if a.tag else ""), False, a.out_dir)
    write_results(path, {"benchmark": "p2p_calls", "machine": machine(), "command": " ".join(sys.argv),
                      "frames": a.frames, "warmup": a.warmup, "modes": modes, "cases": cases, "results": table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
