"""CUDA paths: side streams ordered by events (one GPU), and NCCL channels (two GPUs)."""

from __future__ import annotations

import time

import pytest
import torch

from hybridpipe.comm.p2p import MODES
from hybridpipe.comm.p2p.device import SideStream, hand_over, mark_ready, wait_event

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_side_stream_copy_is_ordered_after_compute_and_before_use():
    dev = torch.device("cuda")
    side = SideStream(dev)
    for _ in range(5):
        torch.cuda._sleep(20_000_000)                    # keep the compute stream busy
        src = torch.arange(1 << 20, device=dev, dtype=torch.float32) * 3
        ready = mark_ready(dev)
        with side.active(after=ready):                   # a "transfer": a copy on the side stream
            dst = torch.empty_like(src)
            dst.copy_(src)
        done = side.record()
        hand_over({"x": dst}, (done,))
        assert torch.equal(dst * 1, src)                 # compute sees the finished copy


def test_compute_does_not_wait_for_the_side_stream_unless_asked():
    dev = torch.device("cuda")
    side = SideStream(dev)
    (torch.ones(16, device=dev) * 2).sum().item()      # load the kernels first: CUDA's lazy module loading
    #                                                    waits for the device to be idle (measured 1.04 s here)
    with side.active():
        torch.cuda._sleep(2_000_000_000)                 # a long "transfer" (about a second)
    busy = side.record()
    t0 = time.monotonic()
    (torch.ones(16, device=dev) * 2).sum().item()      # compute goes on meanwhile
    assert time.monotonic() - t0 < 0.5 and not busy.query()
    assert not wait_event(busy, time.monotonic() + 0.01)  # a deadline before completion is reported
    assert wait_event(busy, time.monotonic() + 60)


def test_default_stream_mode_uses_the_compute_stream():
    assert SideStream(torch.device("cuda"), dedicated=False).stream == torch.cuda.default_stream()
    assert SideStream(torch.device("cpu")).stream is None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between processes needs two GPUs")
def test_nccl_round_trips_every_mode():
    from tests.comm.p2p import scenarios
    from tests.comm.p2p.procs import expect_ok, run_ranks
    values = expect_ok(run_ranks(scenarios.cuda_roundtrip, 2, args=(MODES, 8), timeout=300))
    assert all(report[m] == [] for report in values.values() for m in MODES)
