"""Is a rank's process alive? Checked directly for the ranks on this host (FailureGuard's watchdog).

``host_identity()`` is equal for two processes exactly when one can look up the other's pid:
same host name, same boot and same pid namespace (containers on one host differ).
"""

from __future__ import annotations

import os
import socket


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
