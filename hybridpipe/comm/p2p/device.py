"""Ordering communication against compute: CUDA streams and events, no-ops on CPU.

On CUDA every (peer, direction) gets its own side stream, so a transfer never queues behind
compute or behind another peer's transfer (seed 003, proposal 1):

* send: the caller records an event on its current (compute) stream when it hands tensors
  over; the send thread makes the side stream wait for that event before posting, so the
  transfer starts as soon as the producing kernels are done and compute goes on meanwhile.
* recv: buffers are allocated and received on the side stream; an event recorded after the
  transfer is handed to the caller, whose current stream waits for it (and records the
  tensors' use on it for the caching allocator). Compute therefore waits exactly for the
  tensors it asked for, nothing else.

Backend waits on NCCL only order streams, so completion is detected by polling the event with
a deadline; that is how CUDA transfers honour the same timeouts as CPU ones.
On CPU the same calls run with ``stream is None`` and every event is ``None``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

import torch


class SideStream:
    """One direction of one link: a CUDA stream, or nothing on CPU.

    ``dedicated=False`` uses the device's default stream instead, i.e. communication queues
    with compute as in PipeDream's original implementation (the baseline of seed 003).
    """

    def __init__(self, device: torch.device, dedicated: bool = True) -> None:
        self.device = device
        if device.type != "cuda":
            self.stream = None
        else:
            self.stream = torch.cuda.Stream(device=device) if dedicated else torch.cuda.default_stream(device)

    @contextlib.contextmanager
    def active(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Make this the current stream (after ``after`` completed, if given)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything queued on this stream so far (None on CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


def mark_ready(device: torch.device) -> torch.cuda.Event | None:
    """On the caller's thread: an event after the kernels that produced the tensors to send."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def wait_event(event: torch.cuda.Event | None, deadline: float) -> bool:
    """Poll ``event`` until it completes (True) or ``deadline`` (monotonic) passes (False)."""
    if event is None:
        return True
    pause = 20e-6
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


def hand_over(tensors: Mapping[str, torch.Tensor], events: tuple) -> None:
    """On the caller's thread: order its current stream after a receive's events and record
    the buffers' use on it (so the caching allocator does not recycle them early)."""
    pending = [e for e in events if e is not None]
    if not pending or not tensors:
        return
    stream = torch.cuda.current_stream(next(iter(tensors.values())).device)
    for e in pending:
        stream.wait_event(e)
    for t in tensors.values():
        t.record_stream(stream)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless ``t`` lives on the channel's device type (and index, on CUDA)."""
    ok = t.device.type == device.type and (device.type != "cuda" or device.index is None
                                           or t.device.index == device.index)
    if not ok:
        raise ValueError(f"tensor {name!r} is on {t.device} but the channels carry {device} tensors; "
                         f"move it with .to({str(device)!r}) or open the channels for {t.device}")
