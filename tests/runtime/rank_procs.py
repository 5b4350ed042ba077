"""Run a function (or launch.py) as N real rank processes (gloo on 127.0.0.1), like torchrun would.

The parent hosts the c10d TCPStore (as torchrun's agent does, so it outlives any rank), forks
one process per rank from the session's warm fork server (tests/forked.py: torch and hybridpipe
already imported) with RANK/WORLD_SIZE/MASTER_* set, and collects exit code, stdout, stderr and
the time each rank ended. Each rank imports ``file.py`` by path, joins the gloo group and calls
``function(rank, world, *args)``; what it returns is printed as ``RESULT <json>`` on stdout.
With ``launch`` every rank runs launch.py's main with those arguments instead (and
``rank_launch(rank)``'s), with torchrun's environment, joining the parent's store
(TORCHELASTIC_USE_AGENT_STORE); ``env`` adds variables (None: removes one). Ranks can be killed one
by one; processes are always reaped (killed at the deadline).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tests import forked

ROOT = Path(__file__).resolve().parents[2]

LAUNCH = ROOT / "launch.py"


def rank_main(path: str, fn_name: str, rank: int, world: int, port: int, pg_timeout: float, args: list) -> None:
    """One rank (in its own process): import ``path``, join the group, print ``fn``'s value."""
    import importlib.util

    import torch
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("rank_program", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timeout = datetime.timedelta(seconds=pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    value = getattr(module, fn_name)(rank, world, *args)
    print("RESULT " + json.dumps(value), flush=True)
    dist.destroy_process_group()


def launch_main(argv: list[str]) -> int:
    """``python launch.py ARGV`` (in its own process)."""
    from hybridpipe.launch import main
    return main(argv)


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
                 pg_timeout: float = 60.0, env: dict | None = None, launch: list[str] | None = None,
                 rank_launch: Callable[[int], list[str]] | None = None) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=pg_timeout))
        self.world = world
        self._dir = tempfile.TemporaryDirectory(prefix="ranks-")
        self.procs: list[forked.Forked] = []
        base_env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
        for key, value in (env or {}).items():         # None: remove the variable
            if value is None:
                base_env.pop(key, None)
            else:
                base_env[key] = value
        for r in range(world):
            argv = [*launch, *(rank_launch(r) if rank_launch is not None else [])] if launch is not None else []
            fn, fn_args, argv = ((launch_main, (argv,), [str(LAUNCH), *argv]) if launch is not None else
                                 (rank_main, (str(file), function, r, world, self.store.port, pg_timeout, list(args)),
                                  ["-c"]))
            self.procs.append(forked.start(fn, fn_args, env=dict(base_env, RANK=str(r), LOCAL_RANK=str(r)), argv=argv,
                                           cwd=str(ROOT), stdout=self._file(r, "out"), stderr=self._file(r, "err")))
        self.ended: dict[int, float] = {}

    def _file(self, rank: int, kind: str) -> str:
        return os.path.join(self._dir.name, f"{rank}.{kind}")

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
        for r, p in enumerate(self.procs):
            out, err = (Path(self._file(r, kind)).read_text() if Path(self._file(r, kind)).exists() else ""
                        for kind in ("out", "err"))
            results.append(RankResult(r, p.returncode, out, err, self.ended.get(r, float("inf"))))
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
        self._dir.cleanup()
