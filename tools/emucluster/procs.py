"""Processes inside the emulated hosts: start, wait with a deadline, stop, collect output.

Each process is started as ``ip netns exec <ns> argv...`` in a session of its own, with
stdout/stderr going to files (so a chatty process can never block on a full pipe). A run
over several hosts ends when all have exited, when one fails (``fail_fast``: the others are
stopped, since they would wait forever for the dead peer) or at the deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.emucluster import netns

POLL_S = 0.05


@dataclass
class HostResult:
    """What one host's command did."""

    host: int                    # host index; -1 for the switch
    argv: list[str]
    returncode: int | None       # negative: killed by that signal
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    stopped: bool = False        # killed because another host's command failed

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.stopped

    def describe(self) -> str:
        who = "switch" if self.host < 0 else f"host {self.host}"
        if self.timed_out:
            state = f"ran past its timeout ({self.seconds:.1f} s) and was killed"
        elif self.stopped:
            state = "was stopped because another host's command failed"
        else:
            state = f"exited with {self.returncode} after {self.seconds:.1f} s"
        return f"{who} {state}"

    def tail(self, lines: int = 12) -> str:
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return "\n".join(text[-lines:])


@dataclass
class HostProcess:
    """A running process inside a host's namespace."""

    host: int
    ns: str
    argv: list[str]
    popen: subprocess.Popen
    out_path: Path
    err_path: Path
    started: float = field(default_factory=time.monotonic)

    def poll(self) -> int | None:
        return self.popen.poll()

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM the process's session, SIGKILL it after ``grace_s``."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        # Children that left the session (or daemonised) are still in the namespace.
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def result(self, *, timed_out: bool = False, stopped: bool = False) -> HostResult:
        return HostResult(self.host, self.argv, self.popen.poll(),
                          self.out_path.read_text(errors="replace"),
                          self.err_path.read_text(errors="replace"),
                          time.monotonic() - self.started, timed_out, stopped)


def in_namespace(ns: str, argv: Sequence[str], hostname: str | None = None,
                 cgroups: Sequence[str | os.PathLike] = ()) -> list[str]:
    """``argv`` run inside network namespace ``ns``; with ``hostname``, in a UTS namespace of its
    own that carries that name (so each emulated host has its own hostname, as real hosts do);
    with ``cgroups``, inside those cgroups (the host's CPU quota and pinning), children included.
    They are joined before ``ip netns exec``, which mounts a sysfs of the namespace's own over /sys."""
    inner = ["ip", "netns", "exec", ns]
    if hostname is not None:
        set_name = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
        inner += ["unshare", "--uts", "--", "sh", "-c", set_name, hostname]
    if not cgroups:
        return [*inner, *argv]
    join = 'for g in $0; do echo $$ > "$g/cgroup.procs" || exit 126; done; exec "$@"'
    return ["sh", "-c", join, " ".join(str(g) for g in cgroups), *inner, *argv]


def start(host: int, ns: str, argv: Sequence[str], env: Mapping[str, str], *, hostname: str | None = None,
          cgroups: Sequence[str | os.PathLike] = (), cwd: str | os.PathLike | None = None,
          log_dir: str | os.PathLike | None = None) -> HostProcess:
    """Start ``argv`` inside namespace ``ns`` (as ``hostname``, in ``cgroups``) with exactly the environment ``env``."""
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="emucluster-"))
    folder.mkdir(parents=True, exist_ok=True)
    label = "switch" if host < 0 else f"h{host}"
    out_path = Path(tempfile.mkstemp(prefix=f"{label}-", suffix=".out", dir=folder)[1])
    err_path = out_path.with_suffix(".err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        popen = subprocess.Popen(in_namespace(ns, argv, hostname, cgroups), stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=err, env=dict(env), cwd=cwd, start_new_session=True)
    return HostProcess(host, ns, list(argv), popen, out_path, err_path)


def wait_all(procs: Sequence[HostProcess], timeout_s: float, *, fail_fast: bool = True,
             clean_namespaces_on_failure: bool = True) -> list[HostResult]:
    """Wait for every process; stop the rest when one fails (``fail_fast``) or at the deadline.

    After a failure or timeout, whatever is still running in the involved namespaces is
    killed too (a torchrun agent's workers, a daemonised helper), so nothing lingers.
    Ctrl-C stops everything and re-raises.
    """
    deadline = time.monotonic() + timeout_s
    results: dict[int, HostResult] = {}
    try:
        while len(results) < len(procs):
            failed = False
            for i, p in enumerate(procs):
                if i not in results and p.poll() is not None:
                    results[i] = p.result()
                    failed |= results[i].returncode != 0
            if len(results) == len(procs):
                break
            if (failed and fail_fast) or time.monotonic() >= deadline:
                timed_out = not (failed and fail_fast)
                for i, p in enumerate(procs):
                    if i not in results:
                        p.stop()
                        results[i] = p.result(timed_out=timed_out, stopped=not timed_out)
                break
            time.sleep(POLL_S)
    finally:
        for i, p in enumerate(procs):
            if i not in results:      # KeyboardInterrupt or another exception
                p.stop()
    ordered = [results[i] for i in range(len(procs))]
    if clean_namespaces_on_failure and not all(r.ok for r in ordered):
        for ns in {p.ns for p in procs}:
            netns.kill_namespace_processes(ns)
    return ordered
