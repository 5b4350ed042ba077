"""The ``sra`` link (seed 003's impl-SRA): one thread that performs the link's transfers in both
directions in an order fixed in advance (see order.py), in lockstep with the peer's thread; it
posts its receive only when its order says so. See links.py for the other modes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpipe.comm.p2p.errors import ProtocolError
from hybridpipe.comm.p2p.frames import Frame, FrameReceiver, FrameSender
from hybridpipe.comm.p2p.groups import PairGroups
from hybridpipe.comm.p2p.links import CLOSE, Link, LinkConfig, Submission, log
from hybridpipe.comm.p2p.mailbox import Outbox
from hybridpipe.comm.p2p.order import RECV, SEND, Cursor, Op, keys_of
from hybridpipe.comm.p2p.wire import Flag


class SraLink(Link):
    mode = "sra"

    def __init__(self, peer: int, groups: PairGroups, cfg: LinkConfig, order: Sequence[Op]) -> None:
        super().__init__(peer, groups, cfg)
        self.order = list(order)
        self.send_keys = Cursor(keys_of(self.order, SEND))
        self.recv_keys = Cursor(keys_of(self.order, RECV))
        self.outbox: Outbox = Outbox(on_starve=self.inboxes[0].poke)
        self.msg_out = 0
        self._thread(self._loop, "sendrecv")

    def submit(self, key, items, ready) -> None:
        expected = self.send_keys.peek()
        if expected != key:
            raise ProtocolError(self.peer, f"send {key!r}", "the sra order " + (
                f"expects {expected!r} as the next send to this rank" if expected else "has no sends to this rank"))
        self.check_usable(f"send {key!r}")
        self.send_keys.advance()
        self.sent.post()
        self.last_sent_key = key
        self.outbox.put(Submission(key, items, ready, self.msg_out, len(items)))
        self.msg_out += 1

    def take(self, key: str, deadline: float) -> Frame:
        expected = self.recv_keys.peek()
        if expected != key:
            raise ProtocolError(self.peer, f"recv {key!r}", "the sra order " + (
                f"expects {expected!r} as the next receive from this rank" if expected
                else "has no receives from this rank"))
        box = self.inboxes[0]
        if (head := box.peek(deadline, check=lambda: self._starved(key))).key != key:
            raise self._mismatch(key, head.key)
        self.recv_keys.advance()
        return box.pop()

    def _starved(self, key: str) -> ProtocolError | None:
        waiting = self.outbox.starved()
        if waiting is None:
            return None
        return ProtocolError(self.peer, f"recv {key!r}", f"the sra order sends {waiting!r} to rank {self.peer} "
                             "before this receive and it has not been sent: that would deadlock; send it "
                             "first or fix the order")

    def request_close(self) -> None:
        self.outbox.put(CLOSE)

    def _loop(self) -> None:
        sender, receiver, box = self.senders[0], self.receivers[0], self.inboxes[0]
        i = 0
        while True:
            op, key = self.order[i % len(self.order)] if self.order else (SEND, "close")
            if op == SEND:
                item = self.outbox.get(waiting_for=key if self.order else None)
                if item is CLOSE:
                    return self._close_first(sender, receiver)
                self._send(sender, item)
            else:
                f = receiver.receive(self._deadline(), f"recv {key!r}")
                if not self._received(box, f, f):      # the frame is the message
                    return self._send_close(sender)     # the peer closed first: answer
            i += 1

    def _close_first(self, sender: FrameSender, receiver: FrameReceiver) -> None:
        """We close while the peer's thread waits to receive: send CLOSE, then await its CLOSE."""
        self._send_close(sender)
        while not (f := receiver.receive(self._deadline(), "the peer's close")).header.flags & Flag.CLOSE:
            log.warning("rank %d sent %r while closing; dropped", self.peer, f.key)
        self.closed_by_peer = True
