"""Everything one rank does with one peer, in each of the three modes.

* :class:`PerTensorLink` (``per-tensor``, PipeDream's original): a thread per direction and
  tensor slot ("lane"); tensor i of every message travels on lane i with blocking operations.
* :class:`SaLink` (``sa``, seed 003's impl-SA, in link_sa.py): one send and one receive thread;
  all tensors of a message are posted non-blocking, then waited for in order. On CPU the caller
  posts a message itself, and without a timeline waits for its earlier frames itself (no send
  thread) and, while it comes back faster than frames arrive, receives itself too (see there).
  A send's wait never depends on the receiving program for longer than link_sa.PARK_S.
* :class:`SraLink` (``sra``, impl-SRA, in link_sra.py): one thread that performs the link's transfers in both
  directions in an order fixed in advance (see order.py), in lockstep with the peer's thread.

Receive threads of ``per-tensor`` and ``sa`` always have the next frame's receive posted (they
prefetch without bound; a parked ``sa`` thread within PARK_S), so a send never waits for the receiving
program: any program that would run with unbounded buffers runs here, whatever the stage graph (fan-in, skip edges); a
frame is one message into that receive (see wire.py). ``sra`` posts its receive only when its
order says so. A link ends with a CLOSE frame in each direction (see Channels.close).

Background threads wait on the backend with ``idle_timeout`` (a liveness bound: a link with
no progress for that long is dead); the caller's own waits use the channel's ``timeout``.
A failure in any thread of a link is sticky and reaches the caller on its next operation with
that peer, after the messages that arrived before it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridpipe.comm.p2p.device import SideStream
from hybridpipe.comm.p2p.errors import P2PError, PeerLost, ProtocolError, classify_transport_error
from hybridpipe.comm.p2p.frames import Frame, FrameReceiver, FrameSender, Posted, fixed_wait
from hybridpipe.comm.p2p.groups import PairGroups
from hybridpipe.comm.p2p.mailbox import Counter, Mailbox, QueueBox
from hybridpipe.comm.p2p.wire import Flag

log = logging.getLogger(__name__)

TransferHook = Callable[[int, str, int, float, float], None]
Box = Mailbox | QueueBox


@dataclass(frozen=True)
class LinkConfig:
    idle_timeout: float
    clock: Callable[[], float]
    on_transfer: TransferHook | None
    dedicated_streams: bool = True
    transfer_timeout: float | None = None   # CPU sa/per-tensor sends: bound on one frame's completion


@dataclass
class Submission:
    key: str
    items: list[tuple[str, torch.Tensor]]
    ready: torch.cuda.Event | None
    msg: int = 0
    parts: int = 0
    posted: Posted | None = None    # already posted by the caller (CPU sa)


@dataclass
class Message:
    key: str
    tensors: dict[str, torch.Tensor]
    events: tuple


class _Close:
    """Outbox item asking a send thread to send CLOSE and stop."""


CLOSE = _Close()


class Link:
    """Base: sticky failure, completion counting, threads, notification."""

    mode = ""

    def __init__(self, peer: int, groups: PairGroups, cfg: LinkConfig, lanes: int = 1) -> None:
        self.peer = peer
        self.rank = groups.rank
        self.device = groups.device
        self.cfg = cfg
        self.sent = Counter()
        self.last_sent_key: str | None = None
        self.closed_by_peer = False
        self.threads: list[threading.Thread] = []
        # CPU sa/per-tensor sends: how long one frame may take to leave (see _send_deadline)
        bound = cfg.transfer_timeout
        direct = bound is not None and self.mode != "sra" and self.device.type != "cuda"
        self._send_bound: float = bound if direct and bound is not None else cfg.idle_timeout
        self._send_wait = fixed_wait(self._send_bound)     # the same bound, made once (see SaLink._reap)
        self._idle_wait = fixed_wait(cfg.idle_timeout)     # a receive thread's wait for the next frame
        self.senders = [self._end(FrameSender, groups.outbound(peer, i), groups) for i in range(lanes)]
        self.receivers = [self._end(FrameReceiver, groups.inbound(peer, i), groups) for i in range(lanes)]
        self.inboxes: list[Mailbox] = [Mailbox() for _ in range(lanes)]

    def _end(self, cls, route, groups: PairGroups):
        stream = SideStream(groups.device, dedicated=self.cfg.dedicated_streams)
        # transfer times are only read by on_transfer: without it the frames read no clock
        clock = self.cfg.clock if self.cfg.on_transfer is not None else None
        return cls(route, self.peer, stream, clock, prepost=self.mode != "sra")

    # ---- caller side -------------------------------------------------------------------
    def submit(self, key: str, items: list[tuple[str, torch.Tensor]], ready) -> None:
        raise NotImplementedError

    def take(self, key: str, deadline: float) -> Message | Frame:
        """The next message from the peer, if its key is ``key`` (a Frame is a one-frame message)."""
        raise NotImplementedError

    def request_close(self) -> None:
        raise NotImplementedError

    def check_usable(self, what: str) -> None:
        """Raise the link's failure, or PeerLost if the peer closed, before posting ``what``."""
        err = self.sent.error
        if err is not None:
            raise type(err)(self.peer, what, err.detail) from err
        if self.closed_by_peer:
            raise PeerLost(self.peer, what, f"rank {self.peer} closed its channels")

    def wait_sent(self, deadline: float) -> None:
        self.sent.wait_for(self.sent.posted, deadline)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, deadline: float) -> list[str]:
        """Join the threads until ``deadline``; return the names of those still running."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def boxes(self) -> Sequence[Box]:
        """Where this link's receive threads deliver."""
        return self.inboxes

    def undelivered(self) -> list[str]:
        return [getattr(x, "key", "?") for box in self.boxes() for x in box.drain()]

    # ---- thread side -------------------------------------------------------------------
    def _thread(self, target: Callable[[], None], role: str) -> None:
        name = f"p2p-{self.mode}-{self.rank}-{self.peer}-{role}"
        self.threads.append(threading.Thread(target=self._guarded, args=(target,), name=name, daemon=True))

    def _guarded(self, target: Callable[[], None]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)      # a new thread starts on cuda:0
            target()
        except P2PError as e:
            self._fail(e)
        except Exception as e:          # noqa: BLE001 - any failure must reach the caller
            log.exception("p2p thread for rank %d failed", self.peer)
            self._fail(classify_transport_error(e, self.peer, "the link"))

    def _fail(self, err: P2PError) -> None:
        self.sent.fail(err)
        for box in self.boxes():
            box.fail(err)

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.idle_timeout

    def _send_deadline(self) -> float:
        """How long a send thread waits for a frame to leave. On CPU, a peer whose receive
        threads always have receives posted (sa, per-tensor) takes a frame in network time;
        waiting longer than the channel timeout means the peer is gone. That bound matters:
        gloo never wakes the wait on a send that was half written when its peer died."""
        return time.monotonic() + self._send_bound

    def _notify(self, key: str, nbytes: int, t0: float, t1: float) -> None:
        if self.cfg.on_transfer is None:
            return
        try:
            self.cfg.on_transfer(self.peer, key, nbytes, t0, t1)
        except Exception:               # noqa: BLE001 - a broken recorder must not break the link
            log.exception("on_transfer callback failed")

    def _send(self, sender: FrameSender, sub: Submission) -> None:
        posted = sub.posted or sender.post(sub.key, sub.msg, sub.parts, sub.items, ready=sub.ready)
        t1 = sender.complete(posted, self._send_deadline())
        self.sent.complete()
        self._notify(sub.key, posted.nbytes, posted.t0, t1)

    def _send_close(self, sender: FrameSender) -> None:
        sender.complete(sender.post("close", 0, 0, [], flags=Flag.CLOSE), self._deadline())

    def _received(self, box: Box, frame: Frame, item) -> bool:
        """Deliver ``item`` (False and mark the peer closed if the frame is CLOSE)."""
        if frame.header.flags & Flag.CLOSE:
            self.closed_by_peer = True
            box.fail(PeerLost(self.peer, "the next message", f"rank {self.peer} closed its channels"))
            return False
        box.put(item)
        if self.cfg.on_transfer is not None:
            self._notify(frame.header.key, frame.header.payload_bytes, frame.t0, frame.t1)
        return True

    def _mismatch(self, key: str, found: str) -> ProtocolError:
        return ProtocolError(self.peer, f"recv {key!r}", f"the next message from rank {self.peer} is "
                             f"{found!r}; both ranks must send and receive in the same order")


class PerTensorLink(Link):
    mode = "per-tensor"

    def __init__(self, peer: int, groups: PairGroups, cfg: LinkConfig) -> None:
        super().__init__(peer, groups, cfg, lanes=groups.lanes)
        self.lanes = groups.lanes
        self.outboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.lanes)]
        self.msg_out = 0
        self.msg_in = 0
        for lane in range(self.lanes):
            self._thread(functools.partial(self._send_loop, lane), f"send{lane}")
            self._thread(functools.partial(self._recv_loop, lane), f"recv{lane}")

    def submit(self, key, items, ready) -> None:
        if len(items) > self.lanes:
            raise ValueError(f"a message of {len(items)} tensors needs {len(items)} lanes in per-tensor mode, "
                             f"but the groups have {self.lanes}; open the channels with max_tensors>={len(items)}")
        self.check_usable(f"send {key!r}")
        self.last_sent_key = key
        for lane in range(max(len(items), 1)):      # lane 0 always carries the message header
            self.sent.post()
            self.outboxes[lane].put(Submission(key, items[lane:lane + 1], ready, self.msg_out, len(items)))
        self.msg_out += 1

    def take(self, key: str, deadline: float) -> Message:
        head: Frame = self.inboxes[0].peek(deadline)
        if head.key != key:
            raise self._mismatch(key, head.key)
        if head.header.msg != self.msg_in:
            raise ProtocolError(self.peer, f"recv {key!r}", f"message {head.header.msg} arrived where "
                                f"{self.msg_in} was expected")
        frames = [head]
        for lane in range(1, head.header.parts):    # peek all before popping: a timeout loses nothing
            f = self.inboxes[lane].peek(deadline)
            if f.key != key or f.header.msg != head.header.msg:
                raise ProtocolError(self.peer, f"recv {key!r}", f"lane {lane} carries message "
                                    f"{f.header.msg} ({f.key!r}) where {head.header.msg} ({key!r}) was expected")
            frames.append(f)
        for lane in range(len(frames)):
            self.inboxes[lane].pop()
        self.msg_in += 1
        tensors = {name: t for f in frames for name, t in f.tensors.items()}
        return Message(key, tensors, tuple(f.event for f in frames))

    def request_close(self) -> None:
        for box in self.outboxes:
            box.put(CLOSE)

    def _send_loop(self, lane: int) -> None:
        while (item := self.outboxes[lane].get()) is not CLOSE:
            self._send(self.senders[lane], item)
        self._send_close(self.senders[lane])

    def _recv_loop(self, lane: int) -> None:
        while True:
            f = self.receivers[lane].receive(self._deadline())
            if not self._received(self.inboxes[lane], f, f):
                return
