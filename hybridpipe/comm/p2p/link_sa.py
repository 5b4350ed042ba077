"""The ``sa`` link (seed 003's impl-SA, the default): one send and one receive thread; all tensors
of a message are posted non-blocking, then waited for in order. See links.py for the other modes
and what every link shares.

*Sends.* On CPU the caller posts a message itself (gloo's isend does not block) and the send thread
only waits for it to leave: the transfer starts without waiting for a thread to be scheduled.
Where nobody records each send's completion time (no ``on_transfer``: no timeline), a CPU link has
no send thread at all (it is *lazy*): the caller waits for its earlier frames to that peer when it
posts the next one, and in ``flush`` / ``close`` (as torch's schedules wait their sends).

*Receives.* The next frame's receive is always posted. The receive thread waits for it while the
caller is away, so that frames keep flowing into fresh buffers without bound whatever the program
(fan-in, skip edges). On a lazy link the caller also receives directly, as torch's schedules do:
once the thread has handed a frame to a caller that was already waiting for it (the caller comes
back faster than frames arrive), the thread *parks* and leaves the posted receive to the caller,
whose ``take`` waits on it itself, decodes the frame and posts the next receive: no thread wake-up
and no hand-over per frame. The parked thread takes the receive back once the caller has not come
for this peer's messages for ``PARK_S`` (or at ``close``), so a frame still never waits longer
than that for its receive to be posted. Whoever waits on the posted receive holds ``own``; the
thread delivers only while holding it, so a caller that holds it and finds nothing queued is next
in line. A caller's own wait is bounded by its deadline on the backend itself, and gloo closes the
connection when such a wait times out: that ``P2PTimeout`` is sticky (the link is unusable).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence

from hybridpipe.comm.p2p.errors import P2PError
from hybridpipe.comm.p2p.frames import Frame, Posted, fixed_wait
from hybridpipe.comm.p2p.groups import PairGroups
from hybridpipe.comm.p2p.links import CLOSE, Box, Link, LinkConfig, Submission, log
from hybridpipe.comm.p2p.mailbox import QueueBox
from hybridpipe.comm.p2p.wire import Flag

PARK_S = 0.05       # a parked receive thread takes the receive back after the caller's absence this long


class SaLink(Link):
    mode = "sa"

    def __init__(self, peer: int, groups: PairGroups, cfg: LinkConfig) -> None:
        super().__init__(peer, groups, cfg)
        self.inbox: QueueBox[Frame] = QueueBox()                 # the caller is the one taker
        self.inboxes = []
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()     # C-level hand-over: no Python lock per frame
        self.msg_out = 0
        self.direct = self.device.type != "cuda"    # the caller posts (see the module docstring)
        # ... and, where no completion time is recorded, waits for the frames itself: no send thread
        self.lazy = self.direct and cfg.on_transfer is None
        self.pending: deque[Posted] = deque()       # lazy: posted frames not yet waited for, oldest first
        # lazy: the receive's owner (see the module docstring) and what the parked thread watches
        self.own = threading.Lock()
        self.taking = False         # the caller is in take()
        self.takes = 0              # takes so far (the parked thread's measure of the caller's absence)
        self.unpark = threading.Event()     # close: the parked thread takes the receive back at once
        self._take_wait = fixed_wait(cfg.transfer_timeout or cfg.idle_timeout)    # the caller's own wait
        if not self.lazy:
            self._thread(self._send_loop, "send")
        self._thread(self._recv_loop if self.lazy else self._plain_recv_loop, "recv")

    def submit(self, key, items, ready) -> None:
        if self.sent.error is not None or self.closed_by_peer:
            self.check_usable(f"send {key!r}")
        if self.lazy:
            pending = self.pending
            try:
                pending.append(self.senders[0].post(key, self.msg_out, len(items), items))
            except P2PError as e:
                self._fail(e)
                raise
            self.last_sent_key = key
            self.msg_out += 1
            if len(pending) > 1:        # the frames before this one have left by now (see _send_deadline)
                self._reap(1, None)     # each within the send bound (a fixed wait: no clock read)
            return
        sub = Submission(key, items, ready, self.msg_out, len(items))
        if self.direct:
            try:
                sub.posted = self.senders[0].post(key, sub.msg, sub.parts, items, ready=ready)
            except P2PError as e:
                self._fail(e)
                raise
        self.sent.post()
        self.last_sent_key = key
        self.outbox.put(sub)
        self.msg_out += 1

    def boxes(self) -> Sequence[Box]:
        return (self.inbox,)

    def take(self, key: str, deadline: float) -> Frame:
        inbox = self.inbox
        if self.lazy:
            self.taking = True
            self.takes += 1
            try:
                if inbox.empty() and self.own.acquire(False):
                    try:            # the thread delivers only holding own: nothing can arrive in the inbox now
                        if inbox.empty() and (f := self._receive_direct(key)) is not None:
                            return f
                    finally:
                        self.own.release()
                head = inbox.take_if(deadline, key)
            finally:
                self.taking = False
        else:
            head = inbox.take_if(deadline, key)
        if head.key != key:
            raise self._mismatch(key, head.key)
        return head

    def _receive_direct(self, key: str) -> Frame | None:
        """The caller's own receive of the next frame (holding ``own``), waiting at most the channel's
        timeout (the caller's deadline, made once): the frame if it is ``key``'s message, else None
        with the frame delivered to the inbox as the thread would (another key stays queued there,
        a CLOSE fails it)."""
        try:
            f = self.receivers[0].receive(None, wait=self._take_wait)
        except P2PError as e:
            self._fail(e)       # sticky: a backend wait that timed out closed the connection
            raise
        if f.key == key and not f.header.flags & Flag.CLOSE:
            return f
        self._received(self.inbox, f, f)
        return None

    def request_close(self) -> None:
        if not self.lazy:
            self.outbox.put(CLOSE)
            return
        try:                            # posted now, waited for in join
            self.pending.append(self.senders[0].post("close", 0, 0, [], flags=Flag.CLOSE))
        except P2PError as e:
            log.warning("rank %d: could not send close to rank %d: %s", self.rank, self.peer, e)

    def wait_sent(self, deadline: float) -> None:
        if self.lazy:
            self._reap(0, deadline)
        else:
            super().wait_sent(deadline)

    def join(self, deadline: float) -> list[str]:
        if self.lazy:
            self.unpark.set()           # the receive thread takes the peer's remaining frames and CLOSE
            try:
                self._reap(0, deadline)
            except P2PError as e:
                log.warning("rank %d: closing the link to rank %d: %s", self.rank, self.peer, e)
        return super().join(deadline)

    def _reap(self, keep: int, deadline: float | None) -> None:
        """Lazy sends: wait (on the caller's thread) until at most ``keep`` frames are in flight,
        until ``deadline`` or (None) each frame at most the send bound.
        A failed link raises its failure at once: its frames will never leave, and waiting for them
        again would spend the whole timeout a second time."""
        pending, sender, wait = self.pending, self.senders[0], self._send_wait
        while len(pending) > keep:
            if (err := self.sent.error) is not None:
                raise err
            try:
                sender.complete(pending[0], deadline, wait)
            except P2PError as e:
                self._fail(e)
                raise
            pending.popleft()

    def _send_loop(self) -> None:
        while (item := self.outbox.get()) is not CLOSE:
            self._send(self.senders[0], item)
        self._send_close(self.senders[0])

    def _plain_recv_loop(self) -> None:
        """Receive every frame (CUDA, or a link whose transfers are recorded)."""
        receive, wait = self.receivers[0].receive, self._idle_wait
        while True:
            f = receive(None, wait=wait)        # at most idle_timeout, as _deadline()
            if not self._received(self.inbox, f, f):    # the frame is the message
                return

    def _recv_loop(self) -> None:
        """Lazy link: receive while the caller is away, park while it receives itself."""
        receive, wait, inbox, own = self.receivers[0].receive, self._idle_wait, self.inbox, self.own
        while True:
            with own:
                while True:
                    f = receive(None, wait=wait)
                    waiting = self.taking       # read before the caller can have it (and leave take)
                    if not self._received(inbox, f, f):
                        return
                    if waiting:         # the caller was waiting for it: it receives the next one itself
                        break
            if not self._park():
                return

    def _park(self) -> bool:
        """Leave the receive to the caller until it has been away ``PARK_S`` (between one and two
        periods) or the link closes; False if the link failed meanwhile."""
        seen = -1
        while not self.unpark.wait(PARK_S):
            if self.inbox.error is not None:
                return False
            if not self.taking and self.takes == seen:
                break
            seen = self.takes
        return self.inbox.error is None
