"""Run a function (or launch.py) as N real rank processes (gloo on 127.0.0.1), like torchrun would.

The parent hosts the c10d TCPStore (as torchrun's agent does, so it outlives any rank), starts
``python -c BOOT`` per rank with RANK/WORLD_SIZE/MASTER_* set, and collects exit code, stdout,
stderr and the time each rank ended. Each rank imports ``file.py`` by path, joins the gloo
group and calls ``function(rank, world, *args)``; what it returns is printed as ``RESULT <json>``
on stdout. With ``command`` every rank runs that command instead (e.g. ``python launch.py ...``)
with torchrun's environment, joining the parent's store (TORCHELASTIC_USE_AGENT_STORE). Ranks can
be killed one by one; processes are always reaped (killed at the deadline).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

BOOT = r"""
import datetime, importlib.util, json, os, sys
import torch, torch.distributed as dist
torch.set_num_threads(1)
path, fn_name, rank, world, port, pg_timeout = sys.argv[1:7]
rank, world, port, pg_timeout = int(rank), int(world), int(port), float(pg_timeout)
args = json.loads(sys.argv[7])
spec = importlib.util.spec_from_file_location("rank_program", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
timeout = datetime.timedelta(seconds=pg_timeout)
store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
value = getattr(module, fn_name)(rank, world, *args)
print("RESULT " + json.dumps(value), flush=True)
dist.destroy_process_group()
"""


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    ended: float                # time.monotonic() when the exit was noticed

    @property
    def value(self):
        lines = [x for x in self.stdout.splitlines() if x.startswith("RESULT ")]
        return json.loads(lines[-1][7:]) if lines else None

    def __repr__(self) -> str:
        return f"<rank {self.rank} rc={self.returncode} stderr={self.stderr[-1500:]!r}>"


class Job:
    """``world`` rank processes running ``file:function``; see the module docstring."""

    def __init__(self, file: str | Path | None, function: str | None, world: int, args: tuple = (), *,
                 pg_timeout: float = 60.0, env: dict | None = None, command: list[str] | None = None) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=pg_timeout))
        self.world = world
        self._files = []
        self.procs: list[subprocess.Popen] = []
        base_env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
        base_env.update(env or {})
        for r in range(world):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self._files.append((out, err))
            cmd = command or [sys.executable, "-c", BOOT, str(file), function, str(r), str(world),
                              str(self.store.port), str(pg_timeout), json.dumps(list(args))]
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(base_env, RANK=str(r), LOCAL_RANK=str(r)),
                                               stdout=out, stderr=err))
        self.ended: dict[int, float] = {}

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to ``rank``; returns the time it was sent."""
        self.procs[rank].send_signal(sig)
        return time.monotonic()

    def poll(self) -> dict[int, int]:
        """Exit codes of the ranks that ended so far (recording when each was first seen ended)."""
        codes = {}
        for r, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None:
                self.ended.setdefault(r, time.monotonic())
                codes[r] = rc
        return codes

    def wait(self, timeout: float) -> list[RankResult]:
        """Wait for every rank (killing those still alive at the deadline); return the results."""
        deadline = time.monotonic() + timeout
        try:
            while len(self.poll()) < self.world and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            self.reap()
        results = []
        for r, (p, (out, err)) in enumerate(zip(self.procs, self._files, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(RankResult(r, p.returncode, out.read(), err.read(), self.ended.get(r, float("inf"))))
            out.close()
            err.close()
        return results

    def reap(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.reap()
