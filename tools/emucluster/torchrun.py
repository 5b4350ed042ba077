"""The per-host ``torchrun`` command line for a multi-node c10d rendezvous in the emulated cluster.

Rendezvous must not depend on name resolution (on a bare network namespace the hostname is the
machine's and resolves to 127.0.0.1; the cluster gives each host its own name, but a job may
run where that is not so):

* each agent is told its own address (``--local-addr``), or it could advertise loopback;
* the c10d handler may not recognise the rendezvous endpoint as its own address, so the
  store's host is named explicitly (``--rdzv-conf is_host=1``) and every other host is told
  it is not (``is_host=0``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_argv(script_and_args: Sequence[str], *, host_index: int, nnodes: int, local_addr: str,
                  endpoint: str, rdzv_id: str, nproc_per_node: int = 1, python: str | None = None,
                  max_restarts: int = 0, join_timeout_s: int = 60) -> list[str]:
    """The command host ``host_index`` runs; host 0 hosts the c10d store at ``endpoint`` (addr:port).

    ``script_and_args`` is what follows torchrun's own options: a script path and its
    arguments, or ``-m module args...``.
    """
    if not script_and_args:
        raise ValueError("torchrun needs a script (or -m module) to run")
    is_host = 1 if host_index == 0 else 0
    return [python or sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={is_host},join_timeout={join_timeout_s}",
            "--local-addr", local_addr,
            "--max-restarts", str(max_restarts),
            *script_and_args]
