"""Who spends a process's background CPU: per-OS-thread CPU time and wake-ups (Linux ``/proc``).

``snapshot()`` reads every thread of this process: CPU nanoseconds (``schedstat``'s first field,
the scheduler's own count, exact at any load), voluntary and involuntary context switches
(``status``: a voluntary one is a wake-up after blocking), and a label: the step thread, a
Python thread by its name (``p2p-sa-1-2-recv`` -> ``p2p recv``), gloo's event-loop threads by
the name torch gives them (``gloo_tcp_loop``), else the thread's ``comm``. ``delta`` turns two
snapshots into per-label totals per step. Threads that ended between the snapshots are missed:
take the second before a peer can have closed its links (before the last step).
"""

from __future__ import annotations

import os
import re
import threading

_P2P = re.compile(r"^p2p-[a-z-]+-\d+-\d+-([a-z]+)\d*$")


def _label(name: str) -> str:
    m = _P2P.match(name)
    return f"p2p {m.group(1)}" if m else name


def snapshot() -> dict[int, tuple[int, int, int, str]]:
    """tid -> (CPU ns, voluntary switches, involuntary switches, label); {} where /proc has no schedstat."""
    names = {t.native_id: _label(t.name) for t in threading.enumerate()}
    names[threading.get_native_id()] = "step"
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        d = f"/proc/self/task/{tid}"
        try:
            with open(d + "/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(d + "/status") as f:
                status = f.read()
            with open(d + "/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue                    # ended while read, or no schedstat
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        inv = int(status.split("\nnonvoluntary_ctxt_switches:")[1].split()[0])
        label = names.get(int(tid)) or ("gloo loop" if comm.startswith("gloo_tcp_loop") else comm)
        out[int(tid)] = (ns, vol, inv, label)
    return out


def delta(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """Per label, between the snapshots, per step: CPU us, wake-ups (voluntary switches),
    involuntary switches, and how many threads carry the label."""
    out: dict[str, dict[str, float]] = {}
    for tid, (ns, vol, inv, label) in after.items():
        ns0, vol0, inv0, _ = before.get(tid, (0, 0, 0, ""))
        row = out.setdefault(label, {"cpu_us": 0.0, "wakeups": 0.0, "preempted": 0.0, "threads": 0})
        row["cpu_us"] += (ns - ns0) / 1e3 / max(steps, 1)
        row["wakeups"] += (vol - vol0) / max(steps, 1)
        row["preempted"] += (inv - inv0) / max(steps, 1)
        row["threads"] += 1
    return out
