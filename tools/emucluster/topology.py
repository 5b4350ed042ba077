"""The emulated cluster as plain data: names, addresses and link shaping (no processes, no root).

An emulated cluster with tag ``T`` and ``n`` hosts consists of::

    namespace emc-T-sw        bridge "br0" (+ the switch's own address .254, unshaped)
                              ports h0 .. h{n-1}  (tbf: bridge -> host direction)
    namespace emc-T-h{i}      "lo" up, "eth0" with address .{i+1}/24
                              eth0 (tbf: host -> bridge direction)
                              hostname emc-T-h{i}, resolvable by every host (/etc/netns/*/hosts)

Each veth pair ``eth0 <-> h{i}`` is created directly inside the two namespaces, so the
machine's own network namespace never holds one of its interfaces, not even for a moment.
Shaping both ends with ``tc tbf`` gives every host a full-duplex link of ``rate`` bits/s to
the switch, like a NIC on a switch port. ``netem`` is missing from this kernel, so there is
no latency emulation: the links have the veth's own latency (tens of microseconds).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from dataclasses import dataclass

from tools.emucluster.errors import EmuClusterError

PREFIX = "emc-"
SWITCH_SUFFIX = "sw"
HOST_IFNAME = "eth0"
BRIDGE_IFNAME = "br0"
DEFAULT_SUBNET = "10.213.0.0/24"

_TAG = re.compile(r"^[a-z0-9][a-z0-9_]{0,23}$")
_TRANSIENT_TAG = re.compile(r"^(?P<pid>\d+)x[0-9a-f]{4}$")
_NS = re.compile(r"^emc-(?P<tag>[a-z0-9][a-z0-9_]*)-(?:sw|h(?P<index>\d+))$")
_RATE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?)(?:bit|b|bps|bit/s)?$", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str | float | int | None) -> int | None:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"10g"`` or a number of Gbit/s.

    ``None``, ``0``, ``"none"`` and ``"unlimited"`` mean an unshaped link (``None``).
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise EmuClusterError(f"link rate {text} Gbit/s is negative; give a positive rate or 0 for unshaped")
        return int(round(text * 1e9)) or None
    s = str(text).strip().lower()
    if s in ("none", "unlimited", "unshaped", "0"):
        return None
    m = _RATE.match(s)
    if not m:
        raise EmuClusterError(f"cannot read link rate {text!r}; write it like 1gbit, 100mbit, 10g or 'none'")
    bits = int(round(float(m["num"]) * _UNIT[m["unit"]]))
    if bits and bits < 10**5:
        raise EmuClusterError(f"link rate {text!r} is below 100 kbit/s; tbf cannot shape that usefully")
    return bits or None


def format_rate(bits_per_s: int | None) -> str:
    """Human form of a rate: ``1 Gbit/s``, ``250 Mbit/s`` or ``unshaped``."""
    if not bits_per_s:
        return "unshaped"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s} bit/s"


@dataclass(frozen=True)
class TbfParams:
    """Arguments of ``tc qdisc add ... tbf``: rate (bit/s), bucket (bytes), queue limit (bytes)."""

    rate_bits: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_params(rate_bits: int, mtu: int) -> TbfParams:
    """A token bucket that lets TCP reach the nominal rate without bursting far above it.

    Bucket: one millisecond at line rate, at least a 64 KiB GSO packet plus one MTU (veth
    hands tbf segmentation-offloaded packets up to 64 KiB; a smaller bucket makes tbf split
    every one of them, and TCP then reaches only 50-75% of the rate here). Queue: 10 ms at
    line rate, at least 4 buckets, like a shallow switch buffer.

    The price: a full bucket lets up to a millisecond's worth (125 KB at 1 Gbit/s) leave an
    idle link at once, so short messages are faster than on a real NIC. A peak bucket
    (``peakrate``) would fix that but its per-packet timers cost so much CPU that with 8
    hosts on 2 cores a 16 MB all-reduce took 4x longer; it is not used.
    """
    rate_bytes = rate_bits / 8
    burst = max(int(rate_bytes * 1e-3), 65536 + mtu)
    limit = max(int(rate_bytes * 10e-3), 4 * burst)
    return TbfParams(rate_bits, burst, limit)


def new_tag(persistent_name: str | None = None) -> str:
    """A cluster tag: the user's name for a persistent cluster, else ``<pid>x<random>``.

    Transient tags carry the owner's pid, so leftovers of a killed owner can be told from
    clusters that are still in use (see :func:`is_leftover`).
    """
    if persistent_name is None:
        return f"{os.getpid()}x{secrets.token_hex(2)}"
    if not _TAG.match(persistent_name) or _TRANSIENT_TAG.match(persistent_name):
        raise EmuClusterError(f"cluster name {persistent_name!r} is not allowed: use 1-24 lowercase letters, "
                              "digits or '_', starting with a letter or digit, not of the form <digits>x<4 hex>")
    return persistent_name


def switch_ns(tag: str) -> str:
    return f"{PREFIX}{tag}-{SWITCH_SUFFIX}"


def host_ns(tag: str, index: int) -> str:
    return f"{PREFIX}{tag}-h{index}"


def hosts_file(entries: list[tuple[str, str]]) -> str:
    """An /etc/hosts for the cluster's namespaces: localhost plus ``(address, name)`` per host."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{addr}\t{name}" for addr, name in entries]
    return "\n".join(lines) + "\n"


def bridge_port(index: int) -> str:
    return f"h{index}"


def parse_ns(name: str) -> tuple[str, int | None] | None:
    """``(tag, host index)`` of one of our namespace names (index None for the switch); else None."""
    m = _NS.match(name)
    if not m:
        return None
    return m["tag"], (int(m["index"]) if m["index"] is not None else None)


def owner_pid(tag: str) -> int | None:
    """The pid that owns a transient cluster, or None for a persistent one."""
    m = _TRANSIENT_TAG.match(tag)
    return int(m["pid"]) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_leftover(tag: str) -> bool:
    """True for a transient cluster whose owning process is gone (safe to clean up)."""
    pid = owner_pid(tag)
    return pid is not None and not pid_alive(pid)


@dataclass(frozen=True)
class AddressPlan:
    """Addresses in one private /24: hosts get .1, .2, ...; the switch gets .254."""

    network: ipaddress.IPv4Network

    @classmethod
    def parse(cls, subnet: str, hosts: int) -> AddressPlan:
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as e:
            raise EmuClusterError(f"subnet {subnet!r} is not an IPv4 network ({e}); "
                                  "give one like 10.213.0.0/24") from None
        if net.prefixlen != 24:
            raise EmuClusterError(f"subnet {subnet} must be a /24 (hosts are .1..N, the switch .254)")
        if not net.is_private:
            raise EmuClusterError(f"subnet {subnet} is not a private range; use one inside 10.0.0.0/8, "
                                  "172.16.0.0/12 or 192.168.0.0/16")
        if not 1 <= hosts <= 253:
            raise EmuClusterError(f"{hosts} hosts do not fit one /24; use 1 to 253 hosts")
        return cls(net)

    def host(self, index: int) -> str:
        return str(self.network.network_address + index + 1)

    @property
    def switch(self) -> str:
        return str(self.network.network_address + 254)

    @property
    def prefixlen(self) -> int:
        return self.network.prefixlen
