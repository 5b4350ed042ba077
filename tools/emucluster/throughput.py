"""Measuring what the emulated links really carry: TCP goodput between two hosts."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.emucluster.cluster import SWITCH, EmulatedCluster

PROBE = str(Path(__file__).with_name("tcpprobe.py"))


@dataclass(frozen=True)
class Goodput:
    """TCP payload rate measured from ``senders`` into host ``dst``."""

    senders: tuple[int, ...]
    dst: int
    gbps: float                  # total goodput into dst
    nominal_gbps: float | None   # the link rate, None if unshaped

    @property
    def fraction(self) -> float | None:
        return self.gbps / self.nominal_gbps if self.nominal_gbps else None


def measure_goodput(cluster: EmulatedCluster, *, senders: Sequence[int] = (0,), dst: int = 1,
                    seconds: float = 3.0, port: int = 5201) -> Goodput:
    """Stream TCP from each host in ``senders`` to ``dst`` for ``seconds``; sum the goodput.

    ``dst`` may be ``SWITCH`` (-1): the switch's own, unshaped port on the bridge.
    """
    if dst in senders:
        raise ValueError("a host cannot send to itself through the bridge")
    target = cluster.switch if dst == SWITCH else cluster.hosts[dst]
    recvs = [cluster.start(target, [sys.executable, PROBE, "recv", "--bind", target.addr,
                                    "--port", str(port + k), "--timeout", str(seconds + 20)])
             for k in range(len(senders))]
    sends = [cluster.start(cluster.hosts[src], [sys.executable, PROBE, "send", "--to", target.addr,
                                                "--port", str(port + k), "--seconds", str(seconds)])
             for k, src in enumerate(senders)]
    results = cluster.wait(recvs + sends, timeout_s=seconds + 30)
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results[:len(recvs)]]
    # Several flows: all bytes over the union of their windows (summing per-flow rates would
    # overstate the total when the windows do not coincide).
    window = max(r["last"] for r in reports) - min(r["first"] for r in reports)
    gbps = sum(r["bytes"] for r in reports) * 8 / window / 1e9 if window > 0 else 0.0
    nominal = cluster.rate_bits / 1e9 if cluster.rate_bits else None
    return Goodput(tuple(senders), dst, gbps, nominal)
