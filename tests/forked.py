"""Rank processes forked from a warm server instead of started as new Python interpreters.

A new interpreter pays 3-4 s of CPU before a rank does anything: importing torch and hybridpipe,
and torch.export's first capture (which imports dynamo and sympy). Most of the default suite's
multi-process tests start 2-5 ranks each, so that was a third of the suite's time. Here
multiprocessing's fork server, a clean single-threaded interpreter started once per test session
with the ranks' settings (OMP_NUM_THREADS=1), loads all that once (tests/warm.py) and forks each
process on request.

A forked process is a real process: its own memory, sockets, signals, exit code and stdout and
stderr, gloo over 127.0.0.1. It starts as a new one would after its imports: with the
environment, working directory and command line it is given (PYTHONPATH's folders put first on
sys.path), Python's and numpy's random
generators seeded from the OS and torch's at its default seed (as the server had it); it ends as
the interpreter would (the function's exit code, 1 with the traceback on an uncaught exception,
-N when killed by signal N; non-daemon threads joined, atexit handlers run).

The torchrun tests still start real interpreters through torchrun (tests/runtime/jobs.py).
Where a CUDA GPU is visible the ranks are spawned as new interpreters instead: the warm server's
first capture initializes CUDA, and a process forked after that cannot use the GPU.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

SERVER_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@functools.cache
def context() -> multiprocessing.context.ForkServerContext:
    """The fork server's context; its server started (once per session) with SERVER_ENV. With a
    CUDA GPU visible: the spawn context (new interpreters; a fork after CUDA's start cannot use it)."""
    import torch
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")     # type: ignore[return-value]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.warm"])
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


class Forked:
    """A forked process behind the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        code = self.process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(fn: Callable[..., Any], args: tuple, *, env: dict[str, str], argv: list[str], cwd: str, stdout: str,
          stderr: str) -> Forked:
    """Fork ``fn(*args)`` (a module-level function: it is pickled) as a new process with this
    environment, ``sys.argv``, working directory, and stdout and stderr written to those files;
    its exit code is what ``fn`` returns (an int), or 0."""
    process = context().Process(target=_enter, args=(fn, args, dict(env), list(argv), cwd, stdout, stderr))
    process.start()
    return Forked(process)


def _enter(fn: Callable[..., Any], args: tuple, env: dict[str, str], argv: list[str], cwd: str, stdout: str,
           stderr: str) -> None:
    """In the forked child: become the new process ``start`` describes, run ``fn``, exit."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = argv
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):    # as a new interpreter's sys.path
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 1
    try:
        value = fn(*args)
        code = value if isinstance(value, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:                   # noqa: BLE001 - what the interpreter does with it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    threading._shutdown()                   # type: ignore[attr-defined]  # as the interpreter's exit does
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
