"""What each rank does in the multi-process channel tests (run through procs.run_ranks).

Every scenario returns plain data (no tensors) describing what it observed; the tests
assert on it. Payload values are a deterministic function of (message, tensor, position),
so a receiver can check every element it got against what the sender must have sent.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from hybridpipe.comm.p2p import Channels, P2PError, link_orders, open_channels, pair_groups

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


# ---------------------------------------------------------------------------------------
def roundtrip(rank: int, world: int, modes: tuple[str, ...], n: int) -> dict:
    """2 ranks, every mode: n messages in flight each way, dtypes, shape changes, empty messages."""
    peer = 1 - rank
    shapes = {"x": ((4, 5), torch.float32), "labels": ((4,), torch.int64), "h": ((2, 3, 2), torch.bfloat16)}
    changes = [  # the 'shape' kind changes shape, dtype and names between messages
        {"y": ((2, 3), torch.float32)}, {"y": ((4, 3), torch.float32)}, {"y": ((4, 3), torch.float64)},
        {"y": ((2, 3), torch.float32), "z": ((0, 5), torch.float16)}, {"y": ((2, 3), torch.float32)},
        {}, {name: ((3,), dt) for name, dt in zip("abcdef", DTYPES)},
    ]
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
        transfers = []
        order = link_orders(prog)[rank] if mode == "sra" else None
        ch = open_channels([(0, 1)], mode, timeout=30, order=order, max_tensors=6,
                           on_transfer=lambda *a: transfers.append(a))
        # a non-contiguous tensor is sent as its contiguous copy
        problems = run_program(ch, prog[rank], msgs)
        ch.close()
        nbytes = sum(t.numel() * t.element_size() for op, p, k in prog[rank] for t in msgs[k].values())
        report[mode] = {"problems": problems, "transfer_bytes": sum(a[2] for a in transfers),
                        "expected_bytes": nbytes, "peers": sorted({a[0] for a in transfers}),
                        "times_ok": all(a[3] <= a[4] for a in transfers)}
    return report
