"""An elastic torchrun job on loopback: one torchrun agent per emulated host (``--nnodes MIN:MAX``,
c10d rendezvous, ``--max-restarts``), and killing one host (its agent and its worker, SIGKILL).

    with ElasticJob(tmp_path, ["launch.py", ...], hosts=4, min_hosts=3) as job:
        job.wait_for(lambda: manifest.exists())
        job.kill_host(3)
        results = job.wait(300)          # every surviving agent's exit code and output

Agent 0 hosts the rendezvous store (``is_host=1``; it must survive). The rendezvous settings
are the ones the README's "When a worker dies" recommends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=2,join_timeout=120"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_argv(script_and_args: Sequence[str], *, host: int, hosts: int, min_hosts: int, endpoint: str,
               max_restarts: int, rdzv_id: str = "hybridpipe-elastic") -> list[str]:
    """The torchrun line of one host (host 0 holds the c10d store)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{min_hosts}:{hosts}",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"{RDZV_CONF},is_host={1 if host == 0 else 0}", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", *script_and_args]


def worker_pids(parent: int) -> list[int]:
    """The pids of the processes whose parent is ``parent`` (an agent's workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


class ElasticJob:
    """``hosts`` torchrun agents on loopback; see the module docstring."""

    def __init__(self, logs: Path, script_and_args: Sequence[str], *, hosts: int = 4, min_hosts: int = 3,
                 max_restarts: int = 2, env: dict | None = None) -> None:
        self.logs, self.hosts = Path(logs), hosts
        endpoint = f"127.0.0.1:{free_port()}"
        self.argv = [agent_argv(script_and_args, host=h, hosts=hosts, min_hosts=min_hosts, endpoint=endpoint,
                                max_restarts=max_restarts) for h in range(hosts)]
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))
        self.agents: list[subprocess.Popen] = []
        self.killed: dict[int, float] = {}        # host -> time.time() of the SIGKILL

    def __enter__(self) -> ElasticJob:
        self.logs.mkdir(parents=True, exist_ok=True)
        for h, argv in enumerate(self.argv):
            with open(self.logs / f"agent-{h}.log", "w") as log:
                self.agents.append(subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True))
            if h == 0:
                time.sleep(0.5)                  # the store's host first
        return self

    def wait_for(self, condition: Callable[[], bool], timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or all(a.poll() is not None for a in self.agents):
                raise TimeoutError(f"the condition did not come true; logs in {self.logs}")
            time.sleep(0.01)

    def worker_rank(self, host: int) -> int:
        """The global rank (``RANK``) torchrun gave host ``host``'s worker."""
        for pid in worker_pids(self.agents[host].pid):
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                       if "=" in item)
            if "RANK" in env:
                return int(env["RANK"])
        raise RuntimeError(f"host {host}'s agent runs no worker now")

    def kill_host(self, host: int) -> None:
        """SIGKILL host ``host``'s agent and its workers (as if the machine died)."""
        agent = self.agents[host]
        workers = worker_pids(agent.pid)
        self.killed[host] = time.time()
        os.kill(agent.pid, signal.SIGKILL)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 300.0) -> list[tuple[int | None, str]]:
        """(exit code, output) of every agent (None for one still running at the deadline: killed)."""
        deadline = time.monotonic() + timeout
        for a in self.agents:
            try:
                a.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [(a.poll(), (self.logs / f"agent-{h}.log").read_text()) for h, a in enumerate(self.agents)]

    def __exit__(self, *exc: object) -> None:
        for a in self.agents:
            pids = worker_pids(a.pid) if a.poll() is None else []      # before the agent goes
            if a.poll() is None:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            a.wait(10)
