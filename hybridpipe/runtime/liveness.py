"""Is a rank's process alive? Checked directly for the ranks on this host (FailureGuard's watchdog).

``host_identity()`` is equal for two processes exactly when one can look up the other's pid:
same host name, same boot and same pid namespace (containers on one host differ).
"""

from __future__ import annotations

import json
import os
import socket
import time

from torch.distributed import Store

from hybridpipe.runtime.failure_facts import Failure


def host_identity() -> str:
    """Processes with the same identity can check each other's pids (same boot, same pid namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{socket.gethostname()}/{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}/no-proc/{os.getpid()}"     # unknown: never compare pids


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X", "x")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class PeerWatch:
    """Which ranks of a job are gone, as one rank's failure watchdog sees them (failure.py): the
    ranks on this host by their pids (``who/<rank>`` in the store: host identity and pid), the
    next rank in a ring by its heartbeat (``hb/<rank>``), ranks that finished (``done/<rank>``)
    never. ``exit/<rank>`` records a rank that left through its guard."""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.peers: dict[int, int] = {}           # ranks seen so far -> pid (-1: another host)
        self.done: set[int] = set()
        self._beats: dict[int, tuple[int, float]] = {}   # local ranks -> (heartbeat, when it last changed)
        self._last_value: dict[int, int] = {}
        self._last_change: dict[int, float] = {}

    def learn(self, store: Store) -> None:
        """Remember the pids of the ranks on this host (once each has registered)."""
        me = host_identity()
        for r in range(self.world_size):
            if r != self.rank and r not in self.peers and store.check([f"who/{r}"]):
                info = json.loads(store.get(f"who/{r}"))
                self.peers[r] = info["pid"] if info["host"] == me else -1

    def local_alive(self) -> list[int]:
        """The ranks on this host that have not finished (alive or not)."""
        return [r for r, pid in self.peers.items() if pid > 0 and r not in self.done]

    def gone_local(self, store: Store) -> list[tuple[bool, float, float, int, int]]:
        """The ranks on this host whose process is gone and that did not finish, each as (left an
        exit record, its time, when its heartbeat last moved, rank, pid)."""
        if len(self.peers) < self.world_size - 1:
            self.learn(store)
        now = time.monotonic()
        dead = []
        for r, pid in self.peers.items():
            if pid <= 0 or r in self.done:
                continue
            beat = store.add(f"hb/{r}", 0)
            if self._beats.get(r, (None, 0.0))[0] != beat:
                self._beats[r] = (beat, now)
            if process_alive(pid):
                continue
            if store.check([f"done/{r}"]):
                self.done.add(r)
                continue
            exited = json.loads(store.get(f"exit/{r}"))["time"] if store.check([f"exit/{r}"]) else None
            dead.append((exited is not None, exited or 0.0, self._beats[r][1], r, pid))
        return dead

    def successor_stalled(self, store: Store) -> int | None:
        """The next unfinished rank in the ring when its heartbeat has not moved for ``timeout`` s."""
        now = time.monotonic()
        for step in range(1, self.world_size):
            r = (self.rank + step) % self.world_size
            if r in self.done:
                continue
            if store.check([f"done/{r}"]):
                self.done.add(r)
                continue
            value = store.add(f"hb/{r}", 0)
            if self._last_value.get(r) != value:
                self._last_value[r], self._last_change[r] = value, now
            elif now - self._last_change[r] > self.timeout:
                return r
            return None
        return None

    def lost_local(self, store: Store, *, silent_only: bool = False) -> Failure | None:
        """The local peer that died first, if any died: one that left no exit record (killed, or
        crashed without a word) before one that left through its guard (e.g. stopped by
        torchrun's agent because of the first); among equals, the stalest heartbeat. With
        ``silent_only``, only one that left no exit record. This rank reports it."""
        dead = self.gone_local(store)
        if silent_only:
            dead = [d for d in dead if not d[0]]
        if not dead:
            return None
        recorded, _, _, r, pid = min(dead)
        if recorded:
            return Failure(r, f"its process {pid} exited", self.rank)
        return Failure(r, f"its process {pid} is gone (killed or crashed without a word)", self.rank)

    def lost_successor(self, store: Store) -> Failure | None:
        """The next rank in the ring as lost when its heartbeat stalled (``successor_stalled``)."""
        r = self.successor_stalled(store)
        if r is None:
            return None
        return Failure(r, f"no heartbeat for {self.timeout:.0f} s (its host or the network is gone, or it is frozen)",
                       self.rank)
