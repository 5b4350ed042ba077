"""torchrun's agents after an in-place recovery: checking in at their exit barrier for the hosts lost.

When its workers end, each torchrun agent waits at an exit barrier until every agent of its
rendezvous round arrives (torch 2.13's ``LocalElasticAgent``: 300 s, a default torchrun offers
no flag for). The agent of a host that died never arrives, so after the survivors went on in place
(runtime/recovery.py) their agents would wait those 300 s after the job's last step before
exiting 0. The reporting worker checks in for the lost agents instead, in the agents' own store
(the c10d rendezvous store, found from the agent's command line or, when the agent shares its
store with the workers, from MASTER_ADDR/MASTER_PORT), under the key torch's barrier counts
(``torch.rendezvous.<run id>.<round>/torchelastic/agent/terminal_state/num_members``, the round
read from the rendezvous state). Best effort: any problem is one logged line, and the agents
then wait out their timeout as they would have.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import pickle
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)
BARRIER = "torchelastic/agent/terminal_state"
DEFAULT_RDZV_PORT = 29400


def agent_argv(pid: int) -> list[str]:
    """The command line of process ``pid`` (the worker's agent: its parent)."""
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def rendezvous_of(argv: list[str]) -> tuple[str, int, str] | None:
    """(host, port, backend) of the rendezvous in a torchrun command line, None if it has none."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser

    start = next((i + 1 for i, a in enumerate(argv) if a == "torch.distributed.run" or a.endswith("torchrun")), None)
    if start is None:
        return None
    args, _ = get_args_parser().parse_known_args(argv[start:])
    if not args.rdzv_endpoint:
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_RDZV_PORT)
    return host, port, args.rdzv_backend


def release_exit_barrier(lost_agents: int, timeout_s: float = 10.0) -> str:
    """Check in ``lost_agents`` times at this torchrun round's exit barrier (see the module
    docstring); returns what was done, one line."""
    run_id, world = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("GROUP_WORLD_SIZE")
    if lost_agents <= 0 or not run_id or not world:
        return "no torchrun agent to stand in for"
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            found = rendezvous_of(agent_argv(os.getppid()))
            if found is None or found[2] != "c10d":
                return "the agent's rendezvous is not c10d: its exit barrier waits for the lost hosts"
            host, port = found[0], found[1]
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        state = pickle.loads(base64.b64decode(store.get(f"torch.rendezvous.{run_id}")))   # our agents wrote it
        barrier = dist.PrefixStore(f"torch.rendezvous.{run_id}.{state.round}", store)
        for _ in range(lost_agents):
            if barrier.add(f"{BARRIER}/num_members", 1) == int(world):
                barrier.set(f"{BARRIER}/last_member", "<val_ignored>")
    except Exception as e:      # noqa: BLE001 - best effort: the agents then wait out their timeout
        log.warning("could not check in at torchrun's exit barrier for %d lost host(s): %s", lost_agents, e)
        return f"torchrun's exit barrier not released ({type(e).__name__}: {e})"
    return f"checked in at torchrun's exit barrier for {lost_agents} lost host(s)"
