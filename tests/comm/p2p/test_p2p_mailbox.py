"""Hand-over between caller and communication threads: FIFO, deadlines, sticky failures."""

from __future__ import annotations

import threading
import time

import pytest

from hybridpipe.comm.p2p.errors import PeerLost, ProtocolError
from hybridpipe.comm.p2p.mailbox import Counter, Expired, Mailbox, Outbox, QueueBox

BOXES = pytest.mark.parametrize("kind", [Mailbox, QueueBox])


def soon(fn, delay=0.05):
    t = threading.Timer(delay, fn)
    t.start()
    return t


@BOXES
def test_mailbox_is_fifo_and_waits_for_a_producer(kind):
    box = kind()
    soon(lambda: [box.put(i) for i in range(3)])
    got = [box.take(time.monotonic() + 5) for _ in range(3)]
    assert got == [0, 1, 2] and box.drain() == []


@BOXES
def test_mailbox_deadline_expires_without_losing_later_items(kind):
    box = kind()
    t0 = time.monotonic()
    with pytest.raises(Expired):
        box.peek(t0 + 0.1)
    assert time.monotonic() - t0 >= 0.1
    box.put("late")
    assert box.take(time.monotonic() + 1) == "late"


@BOXES
def test_failure_is_sticky_but_items_that_arrived_first_are_delivered(kind):
    box = kind()
    box.put("a")
    box.fail(PeerLost(1, "the next message", "gone"))
    box.fail(PeerLost(1, "x", "second failure is ignored"))
    assert box.take(time.monotonic() + 1) == "a"
    for _ in range(2):
        with pytest.raises(PeerLost, match="gone"):
            box.take(time.monotonic() + 1)


@BOXES
def test_failure_wakes_a_waiting_taker_at_once(kind):
    box = kind()
    soon(lambda: box.fail(PeerLost(2, "w", "died")))
    t0 = time.monotonic()
    with pytest.raises(PeerLost):
        box.take(t0 + 10)
    assert time.monotonic() - t0 < 5


def test_check_is_reevaluated_when_poked():
    box = Mailbox()
    flag = threading.Event()
    soon(lambda: (flag.set(), box.poke()))
    with pytest.raises(ProtocolError):
        box.peek(time.monotonic() + 10, check=lambda: ProtocolError(0, "r", "stuck") if flag.is_set() else None)


def test_outbox_reports_what_its_consumer_starves_for():
    pokes = []
    box = Outbox(on_starve=lambda: pokes.append(box.starved()))
    got = []
    consumer = threading.Thread(target=lambda: got.append(box.get(waiting_for="act/1")))
    consumer.start()
    deadline = time.monotonic() + 5
    while box.starved() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box.starved() == "act/1" and pokes == ["act/1"]
    box.put("msg")
    consumer.join(5)
    assert got == ["msg"] and box.starved() is None
    box.put("queued")
    assert box.get(waiting_for="x") == "queued" and len(pokes) == 1   # no wait, no poke


def test_counter_waits_for_completions_and_reports_failure():
    c = Counter()
    for _ in range(3):
        c.post()
    soon(lambda: [c.complete() for _ in range(3)])
    c.wait_for(c.posted, time.monotonic() + 5)
    c.post()
    with pytest.raises(Expired):
        c.wait_for(c.posted, time.monotonic() + 0.05)
    c.fail(PeerLost(1, "send", "gone"))
    with pytest.raises(PeerLost):
        c.wait_for(c.posted, time.monotonic() + 5)


def test_queue_box_drain_takes_what_is_left_and_keeps_the_failure():
    box = QueueBox()
    for i in range(3):
        box.put(i)
    assert box.peek(time.monotonic() + 1) == 0          # peeked, not taken: drained too
    box.fail(PeerLost(1, "w", "gone"))
    box.put("after the failure")
    assert box.drain() == [0, 1, 2, "after the failure"]
    with pytest.raises(PeerLost, match="gone"):
        box.peek(time.monotonic() + 1)
