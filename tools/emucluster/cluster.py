"""``EmulatedCluster``: N hosts on one machine, each in a network namespace behind a shaped link.

    with EmulatedCluster(4, rate="1gbit") as cluster:
        results = cluster.run([sys.executable, "train.py"], timeout_s=120)
        results = cluster.torchrun(["train.py", "--steps", "10"], timeout_s=300)

Building needs root, ``ip`` and ``tc`` (refused with a clear message otherwise). Teardown
kills the processes in each namespace first, then deletes the namespaces; it runs on leaving
the ``with`` block for any reason (an error, Ctrl-C). Clusters of a process that died
without tearing down are found by name (their tag carries the owner's pid) and removed by
:func:`cleanup_leftovers` / ``python -m tools.emucluster cleanup``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.emucluster import cpu, netns, procs
from tools.emucluster.errors import EmuClusterError, HostCommandFailed
from tools.emucluster.procs import HostProcess, HostResult
from tools.emucluster.topology import (
    BRIDGE_IFNAME,
    DEFAULT_SUBNET,
    HOST_IFNAME,
    AddressPlan,
    bridge_port,
    format_rate,
    host_ns,
    hosts_file,
    is_leftover,
    new_tag,
    parse_ns,
    parse_rate,
    switch_ns,
    tbf_params,
)
from tools.emucluster.torchrun import torchrun_argv

log = logging.getLogger(__name__)

SWITCH = -1
Command = Sequence[str] | Callable[["Host"], Sequence[str]]


@dataclass(frozen=True)
class Host:
    """One emulated host (``index`` -1 is the switch: the bridge's own namespace)."""

    index: int
    ns: str
    addr: str
    ifname: str

    @property
    def name(self) -> str:
        """Its hostname (the namespace's name), resolvable inside the cluster."""
        return self.ns


class EmulatedCluster:
    """N emulated hosts on one bridge; see the module docstring."""

    def __init__(self, hosts: int, rate: str | float | None = "1gbit", *, mtu: int = 1500,
                 subnet: str = DEFAULT_SUBNET, name: str | None = None, cpus: float | None = None,
                 cpu_period_us: int = cpu.DEFAULT_PERIOD_US, log_dir: str | os.PathLike | None = None) -> None:
        """``rate``: per-host link rate (``"1gbit"``, ``10`` = 10 Gbit/s, ``None`` = unshaped).

        ``cpus``: cores each host may use (a CFS quota per host, see ``cpu.py``; ``None``: the
        hosts share the machine's cores freely).

        ``name`` makes a persistent cluster that outlives this process (the CLI's ``up``);
        without it the cluster gets a transient tag carrying this process's pid.
        """
        if not 68 <= mtu <= 65535:
            raise EmuClusterError(f"MTU {mtu} is out of range; use 68..65535 (1500 is Ethernet, 9000 jumbo)")
        self.rate_bits = parse_rate(rate)
        self.mtu = mtu
        if cpus is not None:
            cpu.quota_us(cpus, cpu_period_us)          # refuse a bad quota before building anything
        self.cpus = cpus
        self.cpu_period_us = cpu_period_us
        self._cpu: cpu.Controller | None = None
        self._cpuset: cpu.Controller | None = None
        self.addresses = AddressPlan.parse(subnet, hosts)
        self.tag = new_tag(name)
        self.hosts = [Host(i, host_ns(self.tag, i), self.addresses.host(i), HOST_IFNAME) for i in range(hosts)]
        self.switch = Host(SWITCH, switch_ns(self.tag), self.addresses.switch, BRIDGE_IFNAME)
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else None
        self._procs: list[HostProcess] = []
        self._is_up = False

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def __repr__(self) -> str:
        return (f"EmulatedCluster(tag={self.tag!r}, hosts={len(self.hosts)}, "
                f"rate={format_rate(self.rate_bits)!r}, mtu={self.mtu}, cpus={self.cpus})")

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts] + [self.switch.ns]

    def up(self) -> EmulatedCluster:
        """Create the namespaces, bridge, veth pairs, addresses and shaping; undo all on failure."""
        netns.check_prerequisites()
        if self.cpus is not None:
            self._cpu, self._cpuset = cpu.find_controller(), cpu.find_cpuset()
        taken = set(netns.list_namespaces()) & set(self.namespaces)
        if taken:
            raise EmuClusterError(f"a cluster named {self.tag!r} already exists ({sorted(taken)[0]}); "
                                  f"take it down first: python -m tools.emucluster down {self.tag}")
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"emucluster-{self.tag}-"))
        self._is_up = True   # from here on, down() must run whatever happens
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        log.info("emulated cluster %s up: %d hosts at %s, MTU %d, %s", self.tag, len(self.hosts),
                 format_rate(self.rate_bits), self.mtu, "unlimited CPU" if self.cpus is None else
                 f"{self.cpus:g} cores per host")
        return self

    def _build(self) -> None:
        sw = self.switch.ns
        netns.add_namespace(sw)
        netns.ip(sw, "link", "set", "lo", "up")
        netns.ip(sw, "link", "add", BRIDGE_IFNAME, "mtu", str(self.mtu), "type", "bridge", "stp_state", "0")
        shaping = tbf_params(self.rate_bits, self.mtu) if self.rate_bits else None
        for host in self.hosts:
            netns.add_namespace(host.ns)
            port = bridge_port(host.index)
            # Created inside the switch's namespace, its peer straight inside the host's:
            # the machine's own namespace never sees either end.
            netns.ip(sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", host.ifname, "mtu", str(self.mtu), "netns", host.ns)
            netns.ip(sw, "link", "set", port, "master", BRIDGE_IFNAME)
            netns.ip(host.ns, "link", "set", "lo", "up")
            netns.ip(host.ns, "addr", "add", f"{host.addr}/{self.addresses.prefixlen}", "dev", host.ifname)
            if shaping:
                netns.tc(host.ns, "qdisc", "add", "dev", host.ifname, "root", *shaping.tc_args())
                netns.tc(sw, "qdisc", "add", "dev", port, "root", *shaping.tc_args())
            netns.ip(host.ns, "link", "set", host.ifname, "up")
            netns.ip(sw, "link", "set", port, "up")
        etc_hosts = hosts_file([(h.addr, h.name) for h in self.hosts + [self.switch]])
        for ns in self.namespaces:
            netns.write_etc(ns, "hosts", etc_hosts)
        netns.ip(sw, "link", "set", BRIDGE_IFNAME, "mtu", str(self.mtu))
        netns.ip(sw, "addr", "add", f"{self.switch.addr}/{self.addresses.prefixlen}", "dev", BRIDGE_IFNAME)
        netns.ip(sw, "link", "set", BRIDGE_IFNAME, "up")
        if self._cpu is not None and self.cpus is not None:
            cpu.create_groups(self._cpu, self.tag, len(self.hosts), self.cpus, self.cpu_period_us, self._cpuset)

    def down(self) -> None:
        """Stop our processes, kill everything left in each namespace, delete the namespaces."""
        for p in self._procs:
            p.stop(grace_s=1.0)
        self._procs.clear()
        existing = set(netns.list_namespaces()) | set(netns.list_etc()) if os.geteuid() == 0 else set()
        for ns in self.namespaces:            # hosts first, the switch last
            if ns in existing:
                netns.delete_namespace(ns)
        for ctl in (self._cpu, self._cpuset):
            if ctl is not None:
                cpu.remove_groups(ctl, self.tag)
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None
        self._is_up = False

    @classmethod
    def attach(cls, tag: str) -> EmulatedCluster:
        """An object for an existing cluster (e.g. one made by ``up``), read back from the kernel."""
        netns.check_prerequisites()
        mine = [p for p in map(parse_ns, netns.list_namespaces()) if p is not None]
        indices = sorted(i for t, i in mine if t == tag and i is not None)
        if not indices or (tag, None) not in mine:
            raise EmuClusterError(f"no emulated cluster named {tag!r}; see python -m tools.emucluster list")
        if indices != list(range(len(indices))):
            raise EmuClusterError(f"cluster {tag!r} is incomplete (hosts {indices}); remove it with "
                                  f"python -m tools.emucluster down {tag}")
        link = netns.link_json(host_ns(tag, 0), HOST_IFNAME)
        inet = next(a for a in link["addr_info"] if a["family"] == "inet")
        qdisc = [q for q in netns.qdisc_json(host_ns(tag, 0), HOST_IFNAME) if q.get("kind") == "tbf"]
        rate = qdisc[0]["options"]["rate"] * 8 if qdisc else None
        subnet = f"{inet['local'].rsplit('.', 1)[0]}.0/{inet['prefixlen']}"
        self = cls(len(indices), rate / 1e9 if rate else None, mtu=link["mtu"], subnet=subnet)
        self.tag = tag
        self._cpu, self._cpuset = _controller_if_any(), cpu.find_cpuset()
        self.cpus = cpu.host_cpus(self._cpu, tag, 0) if self._cpu else None
        self.hosts = [Host(i, host_ns(tag, i), self.addresses.host(i), HOST_IFNAME) for i in indices]
        self.switch = Host(SWITCH, switch_ns(tag), self.addresses.switch, BRIDGE_IFNAME)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"emucluster-{tag}-"))
        self._is_up = True
        return self

    def detach(self) -> None:
        """Forget an attached cluster without tearing it down (stops only our own processes)."""
        for p in self._procs:
            p.stop(grace_s=1.0)
        self._procs.clear()
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    # ---- running commands ------------------------------------------------------------------

    def env(self, host: Host, base: Mapping[str, str] | None = None, *, ranks: bool = True) -> dict[str, str]:
        """Environment for a process on ``host``: sockets pinned to its interface, master = host 0.

        With ``ranks``, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set for
        ``init_process_group("env://")`` (rank = host index); torchrun sets its own.
        """
        env = dict(os.environ if base is None else base)
        env.update({"GLOO_SOCKET_IFNAME": host.ifname, "TP_SOCKET_IFNAME": host.ifname,
                    "NCCL_SOCKET_IFNAME": host.ifname, "PYTHONUNBUFFERED": "1",
                    "EMUCLUSTER_TAG": self.tag, "EMUCLUSTER_HOST": str(host.index),
                    "EMUCLUSTER_HOSTS": str(len(self.hosts)), "EMUCLUSTER_ADDR": host.addr,
                    "EMUCLUSTER_SWITCH_ADDR": self.switch.addr,
                    "EMUCLUSTER_RATE_BITS": str(self.rate_bits or 0)})
        if ranks and host.index >= 0:
            env.update({"MASTER_ADDR": self.hosts[0].addr, "MASTER_PORT": env.get("MASTER_PORT", "29500"),
                        "RANK": str(host.index), "WORLD_SIZE": str(len(self.hosts)),
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        return env

    def start(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike | None = None) -> HostProcess:
        """Start ``argv`` on ``host`` (or ``cluster.switch``) in the background; stopped by down()."""
        self._require_up()
        proc = procs.start(host.index, host.ns, argv, env if env is not None else self.env(host),
                           hostname=host.name, cgroups=self.cgroups(host), cwd=cwd, log_dir=self.log_dir)
        self._procs.append(proc)
        return proc

    def cgroups(self, host: Host) -> list[Path]:
        """The cgroups holding ``host``'s processes (its CPU quota, its CPU); none without quotas or for the switch."""
        if self._cpu is None or self.cpus is None or host.index < 0:
            return []
        groups = [self._cpu.host_group(self.tag, host.index)]
        if self._cpuset is not None and self._cpuset != self._cpu:
            pinned = self._cpuset.host_group(self.tag, host.index)
            groups += [pinned] if pinned.is_dir() else []
        return groups

    def run(self, command: Command, *, timeout_s: float, hosts: Sequence[Host] | None = None,
            env: Callable[[Host], Mapping[str, str]] | Mapping[str, str] | None = None,
            cwd: str | os.PathLike | None = None, check: bool = True, fail_fast: bool = True) -> list[HostResult]:
        """Run a command on every host at once and wait (at most ``timeout_s``).

        ``command`` is one argv for all hosts or a function ``host -> argv``; ``env`` extra
        variables (a mapping, or a function of the host) on top of :meth:`env`. With
        ``check``, any failure raises :class:`HostCommandFailed` quoting the failing host's
        output; ``fail_fast`` stops the other hosts as soon as one fails.
        """
        targets = list(self.hosts if hosts is None else hosts)
        launches = []
        for host in targets:
            extra = env(host) if callable(env) else (env or {})
            launches.append((host, command(host) if callable(command) else command, {**self.env(host), **extra}))
        return self._run_all(launches, timeout_s, cwd=cwd, check=check, fail_fast=fail_fast)

    def wait(self, started: Sequence[HostProcess], timeout_s: float, *, check: bool = True,
             fail_fast: bool = True) -> list[HostResult]:
        """Wait for processes from :meth:`start` (see :func:`procs.wait_all`); raise on failure with ``check``."""
        try:
            results = procs.wait_all(started, timeout_s, fail_fast=fail_fast)
        finally:
            self._procs = [p for p in self._procs if p not in started]
        if check:
            raise_on_failure(results)
        return results

    def _run_all(self, launches: Sequence[tuple[Host, Sequence[str], Mapping[str, str]]], timeout_s: float, *,
                 cwd: str | os.PathLike | None, check: bool, fail_fast: bool) -> list[HostResult]:
        self._require_up()
        started = []
        try:
            for host, argv, env in launches:
                started.append(self.start(host, argv, env=env, cwd=cwd))
        except BaseException:
            for p in started:
                p.stop()
            raise
        return self.wait(started, timeout_s, check=check, fail_fast=fail_fast)

    def torchrun(self, script_and_args: Sequence[str], *, timeout_s: float, nproc_per_node: int = 1,
                 port: int = 29400, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, check: bool = True) -> list[HostResult]:
        """Multi-node ``torchrun`` with c10d rendezvous on every host; host 0 holds the store."""
        endpoint = f"{self.hosts[0].addr}:{port}"

        def argv(host: Host) -> list[str]:
            return torchrun_argv(script_and_args, host_index=host.index, nnodes=len(self.hosts),
                                 local_addr=host.addr, endpoint=endpoint, rdzv_id=self.tag,
                                 nproc_per_node=nproc_per_node, join_timeout_s=max(10, int(timeout_s)))

        def host_env(host: Host) -> dict[str, str]:
            base = self.env(host, ranks=False)
            for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                base.pop(key, None)
            return {**base, **(env or {})}

        return self._run_all([(h, argv(h), host_env(h)) for h in self.hosts], timeout_s,
                             cwd=cwd, check=check, fail_fast=True)

    # ---- description -----------------------------------------------------------------------

    def cluster_json(self, *, workers_per_host: int = 1, memory_gb: float = 16.0, latency_us: float = 0.0,
                     host_bandwidth_gbps: float = 1000.0) -> dict:
        """This cluster as a partitioner cluster description (``--cluster cluster.json``).

        The network level gets the link rate (unshaped: ``host_bandwidth_gbps``); ``latency_us``
        is what the caller assumes per message, since the emulator adds no latency of its own.
        """
        rate_gbps = (self.rate_bits or 0) / 1e9 or host_bandwidth_gbps
        return {"kind": "cluster", "format": 1, "memory_gb": memory_gb,
                "levels": [{"name": "node", "workers": workers_per_host, "bandwidth_gbps": host_bandwidth_gbps},
                           {"name": "network", "workers": len(self.hosts), "bandwidth_gbps": rate_gbps,
                            "latency_us": latency_us}]}

    def _require_up(self) -> None:
        if not self._is_up:
            raise EmuClusterError("the emulated cluster is not up; use it inside `with EmulatedCluster(...)` "
                                  "or call .up() first")


def raise_on_failure(results: Sequence[HostResult]) -> None:
    """Raise :class:`HostCommandFailed` naming the first failing host, with its output's tail."""
    bad = [r for r in results if not r.ok]
    if not bad:
        return
    first = next((r for r in bad if not r.stopped), bad[0])
    tail = first.tail()
    raise HostCommandFailed(f"{first.describe()}: {' '.join(first.argv)[:200]}"
                            + (f"\n--- its output (last lines) ---\n{tail}" if tail else ""), list(results))


def list_clusters() -> dict[str, list[str]]:
    """Tag -> namespace names of every emulated cluster on this machine (with /etc/netns remnants)."""
    clusters: dict[str, list[str]] = {}
    for ns in sorted(set(netns.list_namespaces()) | set(netns.list_etc())):
        parsed = parse_ns(ns)
        if parsed:
            clusters.setdefault(parsed[0], []).append(ns)
    return clusters


def _is_switch(ns: str) -> bool:
    parsed = parse_ns(ns)
    return parsed is not None and parsed[1] is None


def destroy(tag: str) -> list[str]:
    """Tear down cluster ``tag`` by name (processes first, then namespaces); return what was removed."""
    names = list_clusters().get(tag, [])
    hosts_first = sorted(names, key=lambda n: (_is_switch(n), n))
    for ns in hosts_first:
        netns.delete_namespace(ns)
    for ctl in cpu.present():
        if tag in cpu.list_tags(ctl):
            cpu.remove_groups(ctl, tag)
            hosts_first.append(str(ctl.cluster_dir(tag)))
    return hosts_first


def cleanup_leftovers(*, include_live: bool = False) -> list[str]:
    """Remove clusters whose owning process died (or, with ``include_live``, every cluster)."""
    netns.check_prerequisites()
    removed = []
    groups = {t for ctl in cpu.present() for t in cpu.list_tags(ctl)}
    for tag in sorted(set(list_clusters()) | groups):
        if include_live or is_leftover(tag):
            removed += destroy(tag)
    return removed


def _controller_if_any() -> cpu.Controller | None:
    try:
        return cpu.find_controller()
    except EmuClusterError:
        return None

