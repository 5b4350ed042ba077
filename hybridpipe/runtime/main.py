"""launch.py's body: parse the arguments, check them against the plan, run the worker.

A user error found before the job forms (bad argument, a plan for another model, batch size
or world size) ends every rank with one line on stderr (printed by each host's first local
rank only, as every local rank finds the same) and exit code 2; errors after that are the
FailureGuard's (one line naming the rank that failed first).
"""

from __future__ import annotations

import logging
import os
import sys

from hybridpipe.errors import UserError
from hybridpipe.runtime.config import build_parser, env_world_size, resolve
from hybridpipe.runtime.failure import EXIT_USER_ERROR
from hybridpipe.runtime.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    """Entry point of launch.py (one call per torchrun worker); returns the exit code."""
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve(args, env_world_size())
        run_worker(cfg)
    except UserError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"launch.py: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0
