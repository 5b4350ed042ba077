"""``hybridpipe aggregator``: run a dedicated all-reduce aggregator (seed 001's in-network
aggregation, in software) for one group of workers.

    hybridpipe aggregator --port 29600 --world 4

Workers use it with ``algorithm="aggregator"`` once they know its address:
``AllReducer(group, aggregator="HOST:29600")``, ``HybridDataParallel(..., aggregator=...)``, or
``HYBRIDPIPE_AGGREGATOR=HOST:29600`` in their environment. Place it where the network has a spare
fast port (on the emulated cluster: the switch's namespace). Stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal

from hybridpipe.argtypes import int_range, port, positive_float, positive_int
from hybridpipe.comm.allreduce.dedicated import AggregatorServer
from hybridpipe.errors import UserError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=port, required=True, help="TCP port to listen on (0: any free port, printed)")
    p.add_argument("--world", type=positive_int, required=True, help="workers in the group it serves")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument("--chunk-bytes", type=int_range(64, 1 << 30), default=256 << 10,
                   help="bytes summed per chunk (default 256 KiB)")
    p.add_argument("--buffers", type=int_range(1, 1024), default=4,
                   help="chunk buffers in flight per worker (default 4)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds a silent worker is waited for (default 300)")
    p.add_argument("--sessions", type=positive_int, default=None,
                   help="exit after this many sessions (default: run until stopped)")
    p.add_argument("--threads", type=int_range(1, 1024), default=1,
                   help="torch threads for the sums (default 1: the event loop is single-threaded, and idle "
                        "OpenMP workers spinning would take the CPU the sockets need)")


def run(args: argparse.Namespace) -> int:
    import torch
    torch.set_num_threads(args.threads)
    try:
        server = AggregatorServer(args.host, args.port, args.world, chunk_bytes=args.chunk_bytes,
                                  buffers=args.buffers, timeout_s=args.timeout)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; choose another --port") from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    host, port = server.address
    print(f"aggregator listening on {host}:{port} for {args.world} workers", flush=True)
    try:
        server.serve(args.sessions)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    log.info("served %d session(s)", server.sessions_served)
    return 0
