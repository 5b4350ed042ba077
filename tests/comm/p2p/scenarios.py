"""What each rank does in the multi-process channel tests (run through procs.run_ranks).

Every scenario returns plain data (no tensors) describing what it observed; the tests
assert on it. Payload values are a deterministic function of (message, tensor, position),
so a receiver can check every element it got against what the sender must have sent.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading

import torch

from hybridpipe.comm.p2p import Channels, frames, link_orders, open_channels

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64)


def payload(tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose every element depends on ``tag`` and its position (exact in every dtype)."""
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n, dtype=torch.int64) * 7 + tag * 13) % 251
    if dtype == torch.bool:
        return (base % 2 == 1).reshape(shape)
    return base.to(dtype).reshape(shape)


def message(tag: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    return {name: payload(tag * 31 + i, shape, dt) for i, (name, (shape, dt)) in enumerate(shapes.items())}


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return (list(got) == list(want) and all(got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
                                            and torch.equal(got[k], want[k]) for k in want))


def p2p_threads() -> int:
    return sum(t.name.startswith("p2p-") and t.is_alive() for t in threading.enumerate())


def gloo_loop_threads() -> int:
    """This process's gloo event-loop threads (torch names them ``gloo_tcp_loop``)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().startswith("gloo_tcp_loop")
        except OSError:
            continue
    return n


def run_program(ch: Channels, program: list, expected: dict) -> list[str]:
    """Execute ``(op, peer, key)`` steps; sends send ``expected[key]``, receives are compared to it."""
    problems = []
    for op, peer, key in program:
        if op == "send":
            ch.send(peer, key, expected[key])
        else:
            got = ch.recv(peer, key)
            if not same(got, expected[key]):
                problems.append(f"{key} from {peer} differs")
    ch.flush()
    return problems


@contextlib.contextmanager
def counted_sends():
    """Count the point-to-point sends this process posts (the frames' ``post_send``, every send
    they make, wrapped and still called)."""
    real, lock = frames.post_send, threading.Lock()
    calls = [0]

    def post_send(*args, **kwargs):
        with lock:                                  # send threads post too
            calls[0] += 1
        return real(*args, **kwargs)

    frames.post_send = post_send
    try:
        yield calls
    finally:
        frames.post_send = real


@contextlib.contextmanager
def completions_by_thread():
    """Count the frames' send completions (``FrameSender.complete``) per thread name."""
    real, lock = frames.FrameSender.complete, threading.Lock()
    calls: dict[str, int] = {}

    def complete(self, *args, **kwargs):
        with lock:
            name = threading.current_thread().name
            calls[name] = calls.get(name, 0) + 1
        return real(self, *args, **kwargs)

    frames.FrameSender.complete = complete      # type: ignore[method-assign]
    try:
        yield calls
    finally:
        frames.FrameSender.complete = real      # type: ignore[method-assign]


def send_waits(rank: int, world: int, n: int) -> dict:
    """2 ranks, ``sa`` on the CPU, with and without an ``on_transfer`` hook: ``n`` frames each way;
    which threads the links run and which thread waited for each sent frame."""
    peer = 1 - rank
    report = {}
    for hooked in (False, True):
        transfers: list = []
        ch = open_channels([(0, 1)], "sa", timeout=30,
                           on_transfer=(lambda *a: transfers.append(a)) if hooked else None)  # noqa: B023
        msgs = {f"{k}/{i}": message(i + (100 if k == "grad" else 0), {"x": ((2, 3), torch.float32)})
                for k in ("act", "grad") for i in range(n)}
        mine, theirs = ("act", "grad") if rank == 0 else ("grad", "act")
        prog = [op for i in range(n) for op in (("send", peer, f"{mine}/{i}"), ("recv", peer, f"{theirs}/{i}"))]
        threads = sorted(t.name.rsplit("-", 1)[1] for t in threading.enumerate() if t.name.startswith("p2p-"))
        with completions_by_thread() as calls:
            problems = run_program(ch, prog, msgs)
            ch.close()
        caller = threading.current_thread().name
        report["hooked" if hooked else "plain"] = {
            "problems": problems, "threads": threads, "threads_left": p2p_threads(),
            "waited_by_caller": calls.get(caller, 0),
            "waited_elsewhere": sum(v for k, v in calls.items() if k != caller),
            "sent_transfers": sum(1 for a in transfers if a[1].startswith(mine))}
    return report


# ---------------------------------------------------------------------------------------
def roundtrip(rank: int, world: int, modes: tuple[str, ...], n: int, waits: int = 0) -> dict:
    """2 ranks, every mode: n messages in flight each way, dtypes, shape changes, empty messages,
    frames that outgrow the posted receive or travel apart; then ``steady`` more messages of an
    announced shape, counting the sends they cost."""
    peer = 1 - rank
    shapes = {"x": ((4, 5), torch.float32), "labels": ((4,), torch.int64), "h": ((2, 3, 2), torch.bfloat16)}
    changes = [  # the 'shape' kind changes shape, dtype and names between messages
        {"y": ((2, 3), torch.float32)}, {"y": ((4, 3), torch.float32)}, {"y": ((4, 3), torch.float64)},
        {"y": ((2, 3), torch.float32), "z": ((0, 5), torch.float16)}, {"y": ((2, 3), torch.float32)},
        {}, {name: ((3,), dt) for name, dt in zip("abcdef", DTYPES, strict=True)},
        {"y": ((2048,), torch.float32)}, {"y": ((2048,), torch.float32)},     # outgrows 4 KB, then fits
        {"y": ((300_000,), torch.float32), "z": ((5,), torch.int64)},          # 1.2 MB: travels apart
    ]
    steady = 8
    report = {}
    for mode in modes:
        msgs = {}
        prog = {0: [], 1: []}
        for src in (0, 1):
            kind = "act" if src == 0 else "grad"
            for i in range(n):
                msgs[f"{kind}/{i}"] = message(src * 1000 + i, shapes)
                prog[src].append(("send", 1 - src, f"{kind}/{i}"))
                prog[1 - src].append(("recv", src, f"{kind}/{i}"))
        for i, spec in enumerate(changes):
            msgs[f"shape/{i}"] = message(500 + i, spec)
            prog[0].append(("send", 1, f"shape/{i}"))
            prog[1].append(("recv", 0, f"shape/{i}"))
        after = {0: [("send", 1, f"act/{n + i}") for i in range(steady)],
                 1: [("recv", 0, f"act/{n + i}") for i in range(steady)]}
        msgs.update({f"act/{n + i}": message(2000 + i, shapes) for i in range(steady)})
        transfers = []
        order = link_orders({r: prog[r] + after[r] for r in prog})[rank] if mode == "sra" else None
        msgs["act/1"]["x"] = msgs["act/1"]["x"].t().contiguous().t()     # non-contiguous is fine
        ch = open_channels([(0, 1)], mode, timeout=30, order=order, max_tensors=6,
                           on_transfer=lambda *a: transfers.append(a))  # noqa: B023 (closed in this iteration)
        problems = run_program(ch, prog[rank], msgs)
        frames = ch.stats()[peer]["frames_sent"]
        with counted_sends() as sends:
            problems += run_program(ch, after[rank], msgs)
        stats = ch.stats()[peer]
        ch.close()
        ch.close()                                   # idempotent
        prog[rank] += after[rank]
        sent = [msgs[k] for op, _, k in prog[rank] if op == "send"]
        report[mode] = {"problems": problems, "transfer_bytes": sum(a[2] for a in transfers),
                        "expected_bytes": sum(t.numel() * t.element_size() for _, p, k in prog[rank]
                                              for t in msgs[k].values()),
                        "peers": sorted({a[0] for a in transfers}),
                        "times_ok": all(a[3] <= a[4] for a in transfers),
                        "meta_sent": stats["meta_sent"],
                        "meta_expected": announcements(prog[rank], msgs, 6 if mode == "per-tensor" else 1),
                        "sent": len(sent), "threads_left": p2p_threads(),
                        "steady_frames": stats["frames_sent"] - frames, "steady_sends": sends[0]}
    if waits:
        report["send_waits"] = send_waits(rank, world, waits)
    return report


def announcements(program: list, msgs: dict, lanes: int) -> int:
    """Reference: how often metadata must travel for the sends of ``program`` (once per key
    kind, lane and tensor count, again whenever the tensors of that kind change name, dtype or shape)."""
    last: dict = {}
    count = 0
    for op, _, key in program:
        if op != "send":
            continue
        items = list(msgs[key].items())
        per_lane = [items] if lanes == 1 else [items[i:i + 1] for i in range(max(len(items), 1))]
        for lane, part in enumerate(per_lane):
            meta = [(n, t.dtype, tuple(t.shape)) for n, t in part]
            slot = (key.split("/")[0], lane, len(part))
            if last.get(slot) != meta:
                last[slot] = meta
                count += 1
    return count


# ---------------------------------------------------------------------------------------
def graph_programs(fanin_micro: int = 6, skip_micro: int = 3) -> tuple[dict[int, list], dict[str, dict]]:
    """4 ranks: seed 003's AlexNet case (stage 0 replicated on ranks 0-2 feeding rank 3,
    round-robin micro-batches, gradients back), then a chain 0-1-2-3 with skip edges 0-2, 0-3,
    1-3, forward and backward. Returns each rank's program and every message's tensors."""
    prog: dict[int, list] = {r: [] for r in range(4)}
    msgs: dict[str, dict] = {}

    def xfer(src: int, dst: int, key: str, spec: dict, tag: int) -> None:
        prog[src].append(("send", dst, key))
        prog[dst].append(("recv", src, key))
        msgs[key] = message(tag, spec)

    act = {"x": ((8, 16), torch.float32), "labels": ((8,), torch.int64)}
    fanin = [(m, m % 3) for m in range(fanin_micro)]
    for m, r in fanin:                      # all forwards, then all backwards (GPipe-like)
        xfer(r, 3, f"act/{m}", act, 100 + m)
    for m, r in fanin:
        xfer(3, r, f"grad/{m}", {"x": ((8, 16), torch.float32)}, 200 + m)
    hid = {"h": ((4, 8), torch.float32)}
    for m in range(skip_micro):
        t = 300 + 10 * m
        for src, dst in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)):
            xfer(src, dst, f"f{src}{dst}/{m}", hid, t + src * 4 + dst)
        for src, dst in ((3, 2), (3, 1), (3, 0), (2, 1), (2, 0), (1, 0)):
            xfer(src, dst, f"b{src}{dst}/{m}", hid, t + 100 + src * 4 + dst)
    return prog, msgs


def fanin_and_skips(rank: int, world: int, modes: tuple[str, ...]) -> dict:
    prog, msgs = graph_programs()
    edges = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    report = {}
    for mode in modes:
        order = link_orders(prog)[rank] if mode == "sra" else None
        with open_channels(edges, mode, timeout=30, order=order) as ch:
            report[mode] = {"problems": run_program(ch, prog[rank], msgs), "stats": ch.stats()}
        report[mode]["threads_left"] = p2p_threads()
    return report


# ---------------------------------------------------------------------------------------


def cuda_roundtrip(rank: int, world: int, modes: tuple[str, ...], n: int) -> dict:
    """Like ``roundtrip`` with CUDA tensors (NCCL payloads, gloo headers); one GPU per rank."""
    torch.cuda.set_device(rank)
    shapes = {"x": ((64, 128), torch.float32), "labels": ((64,), torch.int64), "h": ((3, 5), torch.bfloat16)}
    report = {}
    for mode in modes:
        prog = {0: [], 1: []}
        cpu = {}
        for src in (0, 1):
            for i in range(n):
                key = f"{'act' if src == 0 else 'grad'}/{i}"
                cpu[key] = message(src * 1000 + i, shapes if i != n - 1 else {"x": ((7,), torch.float16)})
                prog[src].append(("send", 1 - src, key))
                prog[1 - src].append(("recv", src, key))
        order = link_orders(prog)[rank] if mode == "sra" else None
        problems = []
        with open_channels([(0, 1)], mode, device="cuda", timeout=60, order=order) as ch:
            for op, p, key in prog[rank]:
                if op == "send":
                    # produced by a kernel on the compute stream just before the send
                    ch.send(p, key, {k: (v.cuda() * 1).to(v.dtype) for k, v in cpu[key].items()})
                else:
                    got = ch.recv(p, key)
                    # consumed on the compute stream right away: the stream ordering must hold
                    if not same({k: (v * 1).to(v.dtype).cpu() for k, v in got.items()}, cpu[key]):
                        problems.append(key)
            ch.flush()
        report[mode] = problems
    return report


# ---------------------------------------------------------------------------------------
def random_programs(seed: int, ranks: int, events: int) -> dict[int, list]:
    """Programs cut from a random global execution (so they run with unbounded buffers):
    any rank may send to any other at any time, receives come in FIFO order per pair."""
    rng = random.Random(seed)
    progs: dict[int, list] = {r: [] for r in range(ranks)}
    pending: dict[tuple[int, int], list[str]] = {}
    for i in range(events):
        ready = sorted(k for k, v in pending.items() if v)
        if ready and rng.random() < 0.5:
            src, dst = rng.choice(ready)
            progs[dst].append(("recv", src, pending[(src, dst)].pop(0)))
        else:
            src, dst = rng.sample(range(ranks), 2)
            key = f"k{rng.randrange(3)}/{i}"            # three key kinds with varying shapes
            progs[src].append(("send", dst, key))
            pending.setdefault((src, dst), []).append(key)
    for (src, dst), keys in sorted(pending.items()):
        progs[dst] += [("recv", src, k) for k in keys]
    return progs


def random_graphs(rank: int, world: int, modes: tuple[str, ...], seeds: tuple[int, ...]) -> dict:
    """Random traffic between all pairs of ``world`` ranks, every mode; payloads checked."""
    report = {}
    for seed in seeds:
        prog = random_programs(seed, world, 60)
        rng = random.Random(seed)
        msgs = {}
        for ops in prog.values():
            for op, _, key in ops:
                if op == "send":
                    spec = {f"t{j}": ((rng.randrange(0, 5), rng.randrange(1, 9)), rng.choice(DTYPES))
                            for j in range(rng.randrange(0, 4))}
                    msgs[key] = message(len(msgs), spec)
        edges = [(a, b) for a in range(world) for b in range(a + 1, world)]
        for mode in modes:
            order = link_orders(prog)[rank] if mode == "sra" else None
            with open_channels(edges, mode, timeout=60, order=order) as ch:
                report[f"{seed}/{mode}"] = run_program(ch, prog[rank], msgs)
    return report
