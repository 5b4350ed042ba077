"""Thread-safe hand-over points between the caller and the communication threads.

:class:`Mailbox` is a FIFO a background thread fills and a caller drains with a deadline. A
failure of the background side is *sticky*: it is raised to every later taker, but only after
the items that arrived before it (messages received before a peer died are still valid).
:class:`QueueBox` is the same for one taker thread, with no Python lock per item (the items
and the failure travel through a C-level queue): the ``sa`` links' hand-over, once per frame.
:class:`Outbox` is the FIFO in the other direction; it also tells whether its consumer is
blocked waiting for a particular item. :class:`Counter` counts completed operations so that
``flush`` can wait for a number.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from hybridpipe.comm.p2p.errors import P2PError

T = TypeVar("T")


class Expired(Exception):
    """The deadline passed (the caller turns this into P2PTimeout with its own context)."""


class Mailbox(Generic[T]):
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: deque[T] = deque()
        self._error: P2PError | None = None

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def fail(self, error: P2PError) -> None:
        """Record the first failure and wake every waiter."""
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def poke(self) -> None:
        """Wake waiters so they re-evaluate their ``check`` callback."""
        with self._cv:
            self._cv.notify_all()

    @property
    def error(self) -> P2PError | None:
        return self._error

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def peek(self, deadline: float, check: Callable[[], P2PError | None] | None = None) -> T:
        """Wait (until ``deadline``, a ``time.monotonic()`` value) for the head item; do not remove it.

        Raises the sticky error once no items are left, the error ``check`` returns (evaluated on
        every wake-up), or :class:`Expired`.
        """
        with self._cv:
            while True:
                if self._items:
                    return self._items[0]
                if self._error is not None:
                    raise self._error
                if check is not None and (err := check()) is not None:
                    raise err
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Expired()
                self._cv.wait(left)

    def pop(self) -> T:
        with self._cv:
            return self._items.popleft()

    def take(self, deadline: float, check: Callable[[], P2PError | None] | None = None) -> T:
        with self._cv:
            self.peek(deadline, check)
            return self._items.popleft()

    def drain(self) -> list[T]:
        with self._cv:
            items = list(self._items)
            self._items.clear()
            return items


class _Failed:
    def __init__(self, error: P2PError) -> None:
        self.error = error


_EMPTY = object()


class QueueBox(Generic[T]):
    """A :class:`Mailbox` (without ``check``/``poke``) for ONE taker thread: ``put`` and ``fail``
    may come from any thread; a failure is queued behind the items that arrived before it and,
    once reached, raised to every later taker."""

    put: Callable[[T], None]             # the queue's own put: no Python call per item

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._head: object = _EMPTY          # peeked, not yet popped (or the sticky _Failed)
        self._error: P2PError | None = None
        self.put = self._q.put

    def fail(self, error: P2PError) -> None:
        """Queue the failure behind what arrived so far (only the first failure is ever raised)."""
        if self._error is None:
            self._error = error
        self._q.put(_Failed(error))

    @property
    def error(self) -> P2PError | None:
        return self._error

    def empty(self) -> bool:
        """Nothing to take yet (no item, no failure): a ``take`` now would wait."""
        return self._head is _EMPTY and self._q.empty()

    def peek(self, deadline: float) -> T:
        """The head item, waiting until ``deadline`` (``time.monotonic()``); not removed. Raises the
        sticky failure once the items before it are taken, or :class:`Expired`."""
        return self.take_if(deadline, None)

    def pop(self) -> T:
        head, self._head = self._head, _EMPTY
        return head  # type: ignore[return-value]

    def take(self, deadline: float) -> T:
        item = self.peek(deadline)
        self._head = _EMPTY
        return item

    def take_if(self, deadline: float, key: str | None) -> Any:
        """The head item (waiting as :meth:`peek` says), removed only if ``key`` is not None and
        is the item's ``key`` attribute (a message's): one call where ``peek`` and ``pop`` are two."""
        head: Any = self._head
        if head is _EMPTY:
            try:
                head = self._q.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise Expired() from None
        if isinstance(head, _Failed):
            self._head = head
            raise head.error
        self._head = _EMPTY if key is not None and head.key == key else head
        return head

    def drain(self) -> list[T]:
        """Take every item not yet taken (a failure among them stays, sticky, at the head)."""
        pending = [] if self._head is _EMPTY else [self._head]
        while True:
            try:
                pending.append(self._q.get_nowait())
            except queue.Empty:
                break
        failed = [x for x in pending if isinstance(x, _Failed)]
        self._head = failed[0] if failed else _EMPTY
        return [x for x in pending if not isinstance(x, _Failed)]  # type: ignore[misc]


class Counter:
    """A monotonically increasing count of completed operations, with a sticky failure."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._posted = 0
        self._done = 0
        self._waiting = 0           # callers in wait_for: only they need a wake-up
        self.error: P2PError | None = None      # the first failure (read without the lock: one check per send)

    def post(self) -> int:
        with self._cv:
            self._posted += 1
            return self._posted

    def complete(self) -> None:
        with self._cv:
            self._done += 1
            if self._waiting:
                self._cv.notify_all()

    def fail(self, error: P2PError) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self._cv.notify_all()

    @property
    def posted(self) -> int:
        return self._posted

    def wait_for(self, n: int, deadline: float) -> None:
        """Wait until ``n`` operations completed; raise the failure or :class:`Expired`."""
        with self._cv:
            while self._done < n:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Expired()
                self._waiting += 1
                try:
                    self._cv.wait(left)
                finally:
                    self._waiting -= 1


class Outbox(Generic[T]):
    """FIFO from the caller to a communication thread (never times out: the thread idles here).

    ``on_starve`` is called (without the lock held) when the consumer starts waiting for a
    named item on an empty outbox, so that whoever watches :meth:`starved` can re-check.
    """

    def __init__(self, on_starve: Callable[[], None] | None = None) -> None:
        self._cv = threading.Condition()
        self._items: deque[T] = deque()
        self._waiting_for: str | None = None
        self._on_starve = on_starve

    def put(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def get(self, waiting_for: str | None = None) -> T:
        """Block until an item is there; meanwhile :meth:`starved` reports ``waiting_for``."""
        with self._cv:
            if self._items:
                return self._items.popleft()
            self._waiting_for = waiting_for
        if self._on_starve is not None and waiting_for is not None:
            self._on_starve()
        with self._cv:
            while not self._items:
                self._cv.wait()
            self._waiting_for = None
            return self._items.popleft()

    def starved(self) -> str | None:
        """What the consumer is blocked waiting for, if it is blocked on an empty outbox."""
        with self._cv:
            return self._waiting_for if not self._items else None
