"""Running a whole pipeline inside one process, one thread per rank (tests and debugging).

* :class:`InProcessNetwork` connects ranks with FIFO queues per (sender, receiver); each rank's
  :meth:`~InProcessNetwork.transport` has the p2p Channels interface (send/recv/flush/close,
  keys checked on receive, timeouts and a failed peer reported with the comm layer's errors).
* :class:`ReplicaGroup` sums tensors across the replicas of a stage (a barrier-based all-reduce
  with a fixed summation order, so replicas stay bitwise identical); :class:`InProcessGradSync`
  puts the engine's ``no_sync()`` / ``finish()`` interface on top of it.
* :class:`InProcessGroup` gives a replica group's threads point-to-point messages with the
  isend/irecv interface of comm's GroupTransport, so the collectives' executors run unchanged.
* :func:`run_ranks` runs one callable per rank in threads and stops all of them when one fails.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn

from hybridpipe.comm.p2p.errors import P2PTimeout, PeerLost, ProtocolError

T = TypeVar("T")


class InProcessNetwork:
    """Message queues between ranks that live in one process."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._lock = threading.Condition()
        self._queues: dict[tuple[int, int], deque[tuple[str, dict[str, torch.Tensor]]]] = {}
        self._failed: dict[int, str] = {}

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def fail(self, rank: int, reason: str) -> None:
        """Mark ``rank`` as dead: whoever waits on it gets PeerLost at once."""
        with self._lock:
            self._failed[rank] = reason
            self._lock.notify_all()

    def pending(self) -> dict[tuple[int, int], list[str]]:
        """Keys of messages sent but not received, per (sender, receiver)."""
        with self._lock:
            return {k: [key for key, _ in q] for k, q in self._queues.items() if q}

    def _post(self, src: int, dst: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._queues.setdefault((src, dst), deque()).append((key, tensors))
            self._lock.notify_all()

    def _take(self, src: int, dst: int, key: str) -> dict[str, torch.Tensor]:
        what = f"recv {key!r}"
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while True:
                q = self._queues.get((src, dst))
                if q:
                    if q[0][0] != key:
                        raise ProtocolError(src, what, f"the next message from rank {src} is {q[0][0]!r}")
                    return q.popleft()[1]
                if src in self._failed:
                    raise PeerLost(src, what, self._failed[src])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise P2PTimeout(src, what, f"nothing arrived within {self.timeout:g} s")
                self._lock.wait(min(left, 1.0))


class InProcessTransport:
    """One rank's end of an :class:`InProcessNetwork` (the Channels interface)."""

    def __init__(self, network: InProcessNetwork, rank: int):
        self.network, self.rank = network, rank

    def send(self, peer: int, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Post copies of ``tensors`` (the receiver owns what it gets, as across processes)."""
        self.network._post(self.rank, peer, key, {k: t.detach().clone() for k, t in tensors.items()})

    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]:
        return self.network._take(peer, self.rank, key)

    def flush(self, peer: int | None = None) -> None:
        """Sends complete when posted."""

    def close(self) -> None:
        pass


class ReplicaGroup:
    """``size`` threads that sum lists of tensors in place (every member gets the same sum)."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def all_reduce_sum(self, index: int, tensors: list[torch.Tensor]) -> None:
        if self.size == 1:
            return
        self._slots[index] = [t.detach().clone() for t in tensors]
        self._wait()
        for i, t in enumerate(tensors):
            total = self._slots[0][i].clone()
            for slot in self._slots[1:]:
                total += slot[i]
            t.copy_(total)
        self._wait()   # nobody refills a slot before everyone has read them all
        self._slots[index] = []

    def abort(self) -> None:
        self._barrier.abort()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError("a replica of the group failed or timed out during an all-reduce") from None


class InProcessGradSync:
    """``no_sync()`` / ``finish()`` for one replica: ``finish`` sums every parameter's grad across
    the group (a missing grad counts as zeros). Backward inside ``no_sync`` only accumulates.
    ``wire_dtype``: floating gradients are summed in that dtype and cast back (as
    ``HybridDataParallel(wire_dtype=)`` does)."""

    def __init__(self, module: nn.Module, group: ReplicaGroup, index: int, exclude: Collection[nn.Parameter] = (),
                 wire_dtype: torch.dtype | None = None):
        skip = {id(p) for p in exclude}
        self.params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
        self.group, self.index, self.wire_dtype = group, index, wire_dtype
        self._started = False
        self._quiet = 0

    @contextlib.contextmanager
    def no_sync(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def finish(self) -> None:
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        with torch.no_grad():
            if self.wire_dtype is None or self.group.size == 1:
                self.group.all_reduce_sum(self.index, grads)
                return
            low = [g.to(self.wire_dtype) if g.is_floating_point() else g for g in grads]
            self.group.all_reduce_sum(self.index, low)
            for g, s in zip(grads, low, strict=True):
                g.copy_(s)

    def sum_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the group (a replicated stage's batch statistics)."""
        self.group.all_reduce_sum(self.index, [tensor])


class InProcessGroup:
    """Tagged point-to-point messages among ``size`` threads (positions 0..size-1)."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size, self.timeout = size, timeout
        self._lock = threading.Condition()
        self._streams: dict[tuple[int, int, int], list[torch.Tensor | None]] = {}
        self._taken: dict[tuple[int, int, int], int] = {}

    def transport(self, position: int) -> InProcessGroupTransport:
        return InProcessGroupTransport(self, position)

    def _post(self, key: tuple[int, int, int], tensor: torch.Tensor) -> None:
        with self._lock:
            self._streams.setdefault(key, []).append(tensor.detach().clone())
            self._lock.notify_all()

    def _reserve(self, key: tuple[int, int, int]) -> int:
        with self._lock:
            seq = self._taken.get(key, 0)
            self._taken[key] = seq + 1
            return seq

    def _take(self, key: tuple[int, int, int], seq: int, block: bool) -> torch.Tensor | None:
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while len(self._streams.get(key, ())) <= seq:
                left = deadline - time.monotonic()
                if not block:
                    return None
                if left <= 0:
                    raise RuntimeError(f"in-process group: message {key} #{seq} never came")
                self._lock.wait(min(left, 1.0))
            stream = self._streams[key]
            got, stream[seq] = stream[seq], None
            return got


class _Sent:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Received:
    def __init__(self, group: InProcessGroup, key: tuple[int, int, int], seq: int, into: torch.Tensor):
        self.group, self.key, self.seq, self.into, self.done = group, key, seq, into, False

    def _land(self, block: bool) -> bool:
        if not self.done:
            got = self.group._take(self.key, self.seq, block)
            if got is None:
                return False
            self.into.copy_(got)
            self.done = True
        return True

    def wait(self) -> bool:
        return self._land(True)

    def is_completed(self) -> bool:
        return self._land(False)


class InProcessGroupTransport:
    """One position's end of an :class:`InProcessGroup` (GroupTransport's interface)."""

    backend = "inprocess"

    def __init__(self, group: InProcessGroup, position: int):
        self.group, self.position, self.size = group, position, group.size

    def isend(self, tensor: torch.Tensor, position: int, tag: int) -> _Sent:
        self.group._post((self.position, position, tag), tensor)
        return _Sent()

    def irecv(self, tensor: torch.Tensor, position: int, tag: int) -> _Received:
        key = (position, self.position, tag)
        return _Received(self.group, key, self.group._reserve(key), tensor)


def run_ranks(fns: Mapping[int, Callable[[], T]], network: InProcessNetwork | None = None,
              groups: Sequence[ReplicaGroup] = (), timeout: float = 300.0) -> dict[int, T]:
    """Run ``fns[rank]()`` for every rank in its own thread; return their results.

    The first failure marks its rank dead on ``network`` and breaks ``groups``, so the others
    stop waiting for it; that first exception is re-raised here."""
    results: dict[int, T] = {}
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int, fn: Callable[[], T]) -> None:
        try:
            results[rank] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append((rank, e))
            if network is not None:
                network.fail(rank, f"rank {rank} failed: {type(e).__name__}: {e}")
            for g in groups:
                g.abort()

    threads = [threading.Thread(target=body, args=(r, fn), name=f"rank{r}", daemon=True) for r, fn in fns.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks {[t.name for t in threads if t.is_alive()]} still running after {timeout:g} s")
    if errors:
        raise errors[0][1]
    return results
