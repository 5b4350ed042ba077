"""A minimal TCP goodput probe (no iperf needed): ``recv`` on one host, ``send`` on another.

    python tcpprobe.py recv --bind 10.213.0.2 --port 5201          # prints one JSON line
    python tcpprobe.py send --to 10.213.0.2 --port 5201 --seconds 3

The receiver counts payload bytes from the first to the last byte it reads, so connection
setup is not charged (times are CLOCK_MONOTONIC, comparable across namespaces); the result is
goodput (TCP payload), below the link's wire rate by
the header overhead (1448 of 1514 bytes per frame at MTU 1500: at most 95.6%).
Run as a script inside a namespace; it imports nothing from the project.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(bind: str, port: int, timeout_s: float) -> dict:
    with socket.create_server((bind, port), reuse_port=False) as server:
        server.settimeout(timeout_s)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            buf = bytearray(CHUNK)
            total, first, last = 0, None, None
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    total += n          # bytes after the first read arrived within [first, last]
                last = now
    seconds = (last - first) if first is not None and last is not None else 0.0
    return {"bytes": total, "first": first, "last": last, "seconds": seconds,
            "gbps": total * 8 / seconds / 1e9 if seconds > 0 else 0.0}


def send(to: str, port: int, seconds: float, connect_timeout_s: float) -> dict:
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            sock = socket.create_connection((to, port), timeout=connect_timeout_s)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    sent = 0
    with sock:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
            sent += CHUNK
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)           # wait until the receiver has read everything and closed
    return {"bytes": sent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--port", type=int, default=5201)
    r.add_argument("--timeout", type=float, default=30.0)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--seconds", type=float, default=3.0)
    s.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.role == "recv":
        out = receive(args.bind, args.port, args.timeout)
    else:
        out = send(args.to, args.port, args.seconds, args.timeout)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
