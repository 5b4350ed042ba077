"""hybridpipe's torchrun entry point: one process per worker of a plan.

    hybridpipe profile alexnet-small -b 32 -o profile.json
    hybridpipe partition profile.json --cluster examples/clusters/local4.json -o plan.json
    torchrun --standalone --nproc-per-node 4 -m hybridpipe.launch --plan plan.json --steps 100

Across hosts: ``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint
HOST:29500 -m hybridpipe.launch --plan plan.json ...``; ``python -m hybridpipe.launch --help``
lists the options. (In a checkout, ``launch.py`` at the root does the same.)

With ``--profile PROFILE.json --cluster C.json`` instead of ``--plan``, rank 0 plans for the
job's actual world size once the ranks joined (runtime/replan.py) and broadcasts the plan.
Every rank then checks what it was given (numbers, the plan, the run and checkpoint
directories: runtime/config.py's ``resolve``, well under a second) and the ranks agree: if
any rank found a problem, every rank exits 2 with the same line (the first problem by rank),
printed once per host by its first local rank, and no rank starts training. Errors after that
are the FailureGuard's (one line naming the rank that failed first) or agreed stops (a
non-finite loss, no usable checkpoint).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch.distributed as dist

from hybridpipe.errors import UserError, one_line
from hybridpipe.runtime.config import RunConfig, build_parser, deprecations, env_world_size, resolve
from hybridpipe.runtime.failure import EXIT_USER_ERROR
from hybridpipe.runtime.groups import default_backend, init_distributed
from hybridpipe.runtime.replan import agree_plan
from hybridpipe.runtime.worker import run_worker

PROG = "hybridpipe.launch"


def main(argv: list[str] | None = None) -> int:
    """One torchrun worker (or a job of one without torchrun); returns the exit code."""
    milestones = {"imports": time.time()}       # when this worker got how far (the restart record)
    parser = build_parser()
    parser.raise_errors = True
    problem: str | None = None
    cfg: RunConfig | None = None
    args = None
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                 # --help
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    except UserError as e:
        problem = one_line(e)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if args is not None and args.verbose else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    made = False
    try:
        if _under_torchrun():
            made = not dist.is_initialized()
            backend = args.backend if args is not None and args.backend else default_backend()
            init_distributed(backend, args.timeout if args is not None else 300.0)
            milestones["process_group"] = time.time()
        planned, planned_s = None, None
        if problem is None and args is not None and args.profile is not None and args.plan is None:
            planned, problem, planned_s = agree_plan(args, env_world_size())    # same on every rank
        if problem is None and args is not None:
            try:
                cfg = resolve(args, env_world_size(), planned, planned_s)
            except UserError as e:
                problem = one_line(e)
        if _under_torchrun():
            problem = agree_on_problem(problem)
        if problem is not None or cfg is None or args is None:
            _say(f"{PROG}: error: {problem}")
            return EXIT_USER_ERROR
        for line in deprecations(args):
            _say(f"{PROG}: warning: {line}")
        run_worker(cfg, milestones=milestones)
    except UserError as e:                   # before the failure guard: the same on every rank
        _say(f"{PROG}: error: {one_line(e)}")
        return EXIT_USER_ERROR
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def agree_on_problem(problem: str | None) -> str | None:
    """Collective over the job: the first problem any rank found (by rank), or None."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p is not None), None)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") not in ("", "1")


def _say(line: str) -> None:
    """Print on the first local rank of each host only: every local rank has the same line."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
