"""Thin wrappers over ``ip`` and ``tc``: prerequisites, namespaces, links, qdiscs, killing.

Every call is bounded by a timeout and turns a failure into an :class:`EmuClusterError`
that quotes the command and its stderr.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tools.emucluster.errors import EmuClusterError
from tools.emucluster.topology import PREFIX, parse_ns

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 20.0
NETNS_ETC = Path("/etc/netns")    # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


def check_prerequisites() -> None:
    """Refuse clearly unless we are root on Linux with ``ip`` and ``tc`` on PATH."""
    if not os.uname().sysname == "Linux":
        raise EmuClusterError("the emulated cluster needs Linux network namespaces; this is "
                              f"{os.uname().sysname}")
    if os.geteuid() != 0:
        raise EmuClusterError("the emulated cluster needs root (network namespaces, veth, tc); "
                              "run it as root, e.g. sudo .venv/bin/python -m tools.emucluster ...")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmuClusterError(f"{' and '.join(missing)} not found on PATH; install iproute2 "
                              "(apt-get install iproute2) and try again")
    if not os.path.exists("/proc/self/ns/net"):
        raise EmuClusterError("this kernel has no network namespaces (/proc/self/ns/net is missing)")


def run_tool(argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
    """Run ``ip``/``tc``; return stdout; raise EmuClusterError quoting stderr on failure."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EmuClusterError(f"`{' '.join(argv)}` did not finish in {timeout:g} s") from None
    except FileNotFoundError:
        raise EmuClusterError(f"{argv[0]} not found on PATH; install iproute2") from None
    if check and done.returncode != 0:
        hint = ""
        if "tbf" in argv and "Unknown qdisc" in done.stderr:
            hint = "; this kernel lacks sch_tbf (modprobe sch_tbf)"
        raise EmuClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}{hint}")
    return done.stdout


def ip(ns: str | None, *args: str, check: bool = True) -> str:
    """``ip [-n ns] args...``."""
    return run_tool(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(ns: str, *args: str) -> str:
    """``tc -n ns args...``."""
    return run_tool(["tc", "-n", ns, *args])


def add_namespace(name: str) -> None:
    ip(None, "netns", "add", name)


def list_namespaces() -> list[str]:
    """Names of all emulated-cluster namespaces (those named ``emc-<tag>-...``)."""
    out = run_tool(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX) and parse_ns(n) is not None)


def namespace_pids(name: str) -> list[int]:
    """Pids of processes running inside namespace ``name``."""
    out = run_tool(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(name: str, grace_s: float = 2.0) -> int:
    """SIGTERM every process in the namespace, SIGKILL what is left after ``grace_s``; return count."""
    pids = namespace_pids(name)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not namespace_pids(name):
                return len(pids)
            time.sleep(0.05)
        pids = namespace_pids(name)
    if pids:
        log.warning("processes %s in namespace %s survived SIGKILL", pids, name)
    return len(pids)


def delete_namespace(name: str) -> None:
    """Kill its processes, then delete the namespace (and with it its veth ends) and its /etc files."""
    kill_namespace_processes(name)
    ip(None, "netns", "delete", name, check=False)
    remove_etc(name)


def write_etc(name: str, filename: str, text: str) -> None:
    """A file the namespace's processes see as /etc/<filename> (e.g. its own hosts file)."""
    folder = NETNS_ETC / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / filename).write_text(text)


def remove_etc(name: str) -> None:
    """Remove /etc/netns/<name> (only ever one of ours; /etc/netns itself stays)."""
    if parse_ns(name) is None:
        raise ValueError(f"refusing to remove /etc/netns/{name}: not an emulated-cluster namespace")
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def list_etc() -> list[str]:
    """Names of our folders under /etc/netns (left behind if an owner died mid-teardown)."""
    if not NETNS_ETC.is_dir():
        return []
    return sorted(p.name for p in NETNS_ETC.iterdir() if parse_ns(p.name) is not None)


def link_json(ns: str, dev: str) -> dict:
    """``ip -j link show dev`` inside ``ns`` as a dict."""
    return json.loads(ip(ns, "-j", "addr", "show", "dev", dev))[0]


def qdisc_json(ns: str, dev: str) -> list[dict]:
    """``tc -j qdisc show dev`` inside ``ns``."""
    return json.loads(tc(ns, "-j", "qdisc", "show", "dev", dev) or "[]")
