"""Per-host CPU quotas: every emulated host computes on its own share of the machine's cores.

Without a quota, N hosts on one machine share its cores as the scheduler pleases: a host
computes faster while the others wait, which no real cluster does, so a pipeline (some hosts
idle) looks better than it would be and data parallelism (all busy at once) worse. With
``cpus=c`` every process started on a host joins a cgroup of the host's own whose CFS
bandwidth is ``c`` cores (``c x period`` of CPU time per ``period``, all its threads together),
so a host runs at the same speed whatever the other hosts do. Give ``c <= cores / hosts`` for
hosts that never slow each other down.

A quota is a ceiling, not a floor: other work on the machine (a test suite, another session's
build) would still take a host's cores and slow it below ``c``, which a real host, whose cores are
its own, never sees. So the cluster's group also gets the scheduler's largest weight
(``cpu.shares`` 262144 in v1, ``cpu.weight`` 10000 in v2): when the machine is busy the hosts get
their quotas first and everything else shares what is left.

Where the cpuset controller exists and ``c <= 1``, each host is also pinned to one CPU (hosts
spread evenly, at most a CPU's worth of quota per CPU): a lone thread under a quota that
migrates between CPUs loses part of its quota to per-CPU runtime slices that expire unused
(measured here: one busy host alone ran ~15% slower than four busy hosts together); pinned, it
gets its share whatever the others do.

cgroup v1 (``/sys/fs/cgroup/cpu``: ``cpu.cfs_quota_us``, ``cpu.cfs_period_us``) and v2
(``cpu.max``, with ``+cpu`` enabled in the parent's ``cgroup.subtree_control``) are supported.
The groups are ``<controller root>/emucluster-<tag>/h<index>``; they go when the cluster goes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tools.emucluster.errors import EmuClusterError

log = logging.getLogger(__name__)

# the cluster group's scheduler weight, per cgroup version: the kernel's maximum (see the docstring)
PRIORITY = {1: ("cpu.shares", "262144"), 2: ("cpu.weight", "10000")}

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "emucluster-"
DEFAULT_PERIOD_US = 10_000          # short periods: a throttled host waits at most this long
MIN_QUOTA_US = 1_000                # the kernel refuses smaller quotas


@dataclass(frozen=True)
class Controller:
    """Where the cpu controller lives: cgroup ``version`` 1 or 2, our groups under ``root``."""

    version: int
    root: Path

    def cluster_dir(self, tag: str) -> Path:
        return self.root / f"{GROUP_PREFIX}{tag}"

    def host_group(self, tag: str, index: int) -> Path:
        return self.cluster_dir(tag) / f"h{index}"


def _find(base: Path, name: str, v1_file: str) -> Controller | None:
    """Controller ``name``: its v1 hierarchy (``base/name`` holding ``v1_file``), else v2 if it lists it, else None."""
    if (base / name / v1_file).exists():
        return Controller(1, base / name)
    if name in _read(base / "cgroup.controllers").split():
        return Controller(2, base)
    return None


def find_cpuset(base: Path = CGROUP_ROOT) -> Controller | None:
    """The cpuset controller (v1 preferred), or None where there is none."""
    return _find(base, "cpuset", "cpuset.cpus")


def present(base: Path = CGROUP_ROOT) -> list[Controller]:
    """The cpu and cpuset controllers that exist here (where our groups may be)."""
    return [c for c in (_find(base, "cpu", "cpu.cfs_quota_us"), find_cpuset(base)) if c is not None]


def pinning(hosts: int, cpus: float, ncpu: int) -> list[int] | None:
    """The CPU of each host (spread evenly), or None when pinning would put more than one CPU's worth
    of quota on a CPU (or a host needs more than one CPU)."""
    if cpus > 1 or ncpu < 1:
        return None
    where = [i * ncpu // hosts for i in range(hosts)]
    load = [0.0] * ncpu
    for c in where:
        load[c] += cpus
    return where if max(load) <= 1 + 1e-9 else None


def find_controller(base: Path = CGROUP_ROOT) -> Controller:
    """The cpu controller of this machine (v1 preferred where both are mounted); refuse clearly if none."""
    found = _find(base, "cpu", "cpu.cfs_quota_us")
    if found is not None:
        return found
    raise EmuClusterError("per-host CPU quotas need the cgroup cpu controller, "
                          f"found neither {base}/cpu/cpu.cfs_quota_us "
                          f"(cgroup v1) nor 'cpu' in {base}/cgroup.controllers (v2); mount it or run without --cpus")


def quota_us(cpus: float, period_us: int = DEFAULT_PERIOD_US) -> int:
    """CPU time per period (us) for ``cpus`` cores; refuses what the kernel would."""
    if not cpus > 0:
        raise EmuClusterError(f"--cpus must be a positive number of cores per host (e.g. 0.5), got {cpus!r}")
    if not 1_000 <= period_us <= 1_000_000:
        raise EmuClusterError(f"CPU period {period_us} us is out of range; use 1000..1000000 (default "
                              f"{DEFAULT_PERIOD_US})")
    quota = round(cpus * period_us)
    if quota < MIN_QUOTA_US:
        raise EmuClusterError(f"{cpus} cores per host is {quota} us of CPU per {period_us} us period, below the "
                              f"kernel's {MIN_QUOTA_US} us minimum; use a longer period (--cpu-period-us "
                              f"{-(-MIN_QUOTA_US * period_us // quota)}) or more cores")
    return quota


def create_groups(ctl: Controller, tag: str, hosts: int, cpus: float, period_us: int = DEFAULT_PERIOD_US,
                  cpuset: Controller | None = None) -> None:
    """One group per host, each limited to ``cpus`` cores (and, with ``cpuset``, pinned where
    :func:`pinning` allows)."""
    quota = quota_us(cpus, period_us)
    total = cpus * hosts
    cores = os.cpu_count() or 1
    if total > cores + 1e-9:
        log.warning("%d hosts x %g cores = %g cores, more than this machine's %d: busy hosts will slow each other",
                    hosts, cpus, total, cores)
    top = ctl.cluster_dir(tag)
    top.mkdir()
    if ctl.version == 2:
        _write(top / "cgroup.subtree_control", "+cpu")
    _write(top / PRIORITY[ctl.version][0], PRIORITY[ctl.version][1])
    for i in range(hosts):
        group = ctl.host_group(tag, i)
        group.mkdir()
        if ctl.version == 1:
            _write(group / "cpu.cfs_period_us", str(period_us))
            _write(group / "cpu.cfs_quota_us", str(quota))
        else:
            _write(group / "cpu.max", f"{quota} {period_us}")
    where = pinning(hosts, cpus, os.cpu_count() or 1) if cpuset is not None else None
    if where is None or cpuset is None:
        return
    if cpuset == ctl:                              # v2: one hierarchy, the host groups take both
        _write(ctl.cluster_dir(tag) / "cgroup.subtree_control", "+cpuset")
        for i, cpu in enumerate(where):
            _write(ctl.host_group(tag, i) / "cpuset.cpus", str(cpu))
        return
    top = cpuset.cluster_dir(tag)
    top.mkdir()
    mems = _read(cpuset.root / "cpuset.mems").strip() or "0"
    if cpuset.version == 1:                        # v1: a group needs cpus and mems before it takes tasks
        _write(top / "cpuset.cpus", _read(cpuset.root / "cpuset.cpus").strip())
        _write(top / "cpuset.mems", mems)
    else:
        _write(top / "cgroup.subtree_control", "+cpuset")
    for i, cpu in enumerate(where):
        group = cpuset.host_group(tag, i)
        group.mkdir()
        _write(group / "cpuset.cpus", str(cpu))
        if cpuset.version == 1:
            _write(group / "cpuset.mems", mems)


def host_cpus(ctl: Controller, tag: str, index: int) -> float | None:
    """The cores a host's group allows (None: no group or no limit), read back from the kernel."""
    group = ctl.host_group(tag, index)
    if not group.is_dir():
        return None
    if ctl.version == 1:
        quota, period = int(_read(group / "cpu.cfs_quota_us")), int(_read(group / "cpu.cfs_period_us"))
    else:
        text = _read(group / "cpu.max").split()
        if not text or text[0] == "max":
            return None
        quota, period = int(text[0]), int(text[1])
    return quota / period if quota > 0 else None


def remove_groups(ctl: Controller, tag: str, grace_s: float = 2.0) -> None:
    """Kill whatever still runs in the cluster's groups, then remove them (no-op if absent)."""
    top = ctl.cluster_dir(tag)
    if not top.is_dir():
        return
    for group in sorted(p for p in top.iterdir() if p.is_dir()):
        deadline = time.monotonic() + grace_s
        while _pids(group):
            for pid in _pids(group):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise EmuClusterError(f"processes {_pids(group)} in {group} survived SIGKILL; remove the group "
                                      f"by hand (rmdir {group}) once they are gone")
            time.sleep(0.05)
        group.rmdir()
    top.rmdir()


def list_tags(ctl: Controller) -> list[str]:
    """Tags of the clusters that have CPU groups on this machine."""
    if not ctl.root.is_dir():
        return []
    return sorted(p.name[len(GROUP_PREFIX):] for p in ctl.root.iterdir()
                  if p.is_dir() and p.name.startswith(GROUP_PREFIX))


def _pids(group: Path) -> list[int]:
    return [int(x) for x in _read(group / "cgroup.procs").split()]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise EmuClusterError(f"cannot write {text!r} to {path}: {e.strerror}; per-host CPU quotas need root and a "
                              "writable cgroup cpu controller (run without --cpus otherwise)") from e
