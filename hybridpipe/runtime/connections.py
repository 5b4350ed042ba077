"""Cutting this process's connections to its peers, so that every wait on them ends at once.

A gloo operation waits until its peer answers, the connection closes, or the group's timeout
(minutes) passes; ``Backend.abort()`` closes the connections for the peers but does not wake this
process's own waiters (measured on torch 2.13: a local abort left an all-reduce waiting for its
full timeout). Shutting a connected socket down (``shutdown(SHUT_RDWR)``) does both: gloo's event
loop sees the connection end, fails every operation pending on it here, and the peer sees it
closed. :func:`cut_connections` does that to every established TCP connection of this process
except those of the c10d store (its port, client or server side), which the survivors need to
agree and to form their new groups. Listening sockets are left alone (gloo's listener aborts the
process when its socket is shut down). Linux only (``/proc/self/net/tcp*``, ``/proc/self/fd``).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ESTABLISHED = 0x01          # the state column of /proc/net/tcp


def tcp_connections() -> dict[int, tuple[int, int, int]]:
    """This process's TCP sockets: fd -> (local port, remote port, state)."""
    by_inode: dict[int, tuple[int, int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            try:
                by_inode[int(cols[9])] = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16),
                                          int(cols[3], 16))
            except (IndexError, ValueError):
                continue
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and (inode := int(target[8:-1])) in by_inode:
            found[int(name)] = by_inode[inode]
    return found


def cut_connections(keep_port: int | None) -> int:
    """Shut down every established TCP connection of this process but those from or to
    ``keep_port`` (the store's); returns how many were cut."""
    cut = 0
    for fd, (local, remote, state) in tcp_connections().items():
        if state != ESTABLISHED or keep_port in (local, remote):
            continue
        try:
            dup = socket.socket(fileno=os.dup(fd))     # shutdown acts on the socket, not the descriptor
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            dup.close()
    log.info("cut %d connection(s) (kept port %s)", cut, keep_port)
    return cut


def store_port(store: object) -> int | None:
    """The TCP port of a c10d store (a TCPStore, or a PrefixStore over one); None if unknown."""
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    port = getattr(store, "port", None)
    return int(port) if isinstance(port, int) else None
