"""One job per checkpoint directory: an exclusive lock held for the job's whole life.

    lock, note = DirLock.acquire(root, Holder.here())     # one rank; UserError: another job has it
    ...                                                   # note: "" or the line saying whose lock was taken over
    lock.release()

**Which rank, which filesystem.** ``--checkpoint-dir`` is one directory that every rank of the
job sees: a shared filesystem across hosts, or a local disk when the job runs on one host. The
checkpoint format needs that already (one rank commits each step, and resume refuses ranks that
see no checkpoint), so one lock per job is enough; rank 0 holds it (every attempt of an elastic
job has a rank 0, and it decides before any rank writes into the directory).

**The lock** is ``fcntl.flock`` on ``DIR/hybridpipe.lock``, whose content records the holder as
JSON (torchrun's run id ``TORCHELASTIC_RUN_ID``, its restart count, host, pid, start time); a
release empties it. The kernel drops a flock when its process ends, however it ends, so a job
that crashed or was killed never blocks the next one: the next one takes the lock over and says
whose it was (the record is still there). Linux implements flock on NFS with the server's locks,
shared between hosts; a host that dies holding one keeps it until the server's lease expires
(NFSv4: 90 s by default).

**A lock held by someone else** is taken over (with a line) when it is stale: its recorded process
is gone from this host (a process it left behind still holds the flock), or it belongs to an
earlier attempt of this very job (same run id, lower restart count) on another host (one that
died, on a network filesystem). Anything else is another job: :class:`UserError` naming it,
and nothing in the directory was changed. A lock taken over is claimed in the background as soon
as its leftover holder lets go. On a filesystem without locks (``ENOLCK``) only the record is
checked: it cannot tell two jobs started at the same instant apart, and a line says so.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from hybridpipe.errors import UserError, one_line
from hybridpipe.jsonfile import file_mode
from hybridpipe.runtime.checkpoint_files import check_fresh
from hybridpipe.runtime.liveness import host_identity, process_alive

LOCK_NAME = "hybridpipe.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a checkpoint directory's lock."""

    run_id: str         # torchrun's TORCHELASTIC_RUN_ID ("" without torchrun)
    restart: int        # TORCHELASTIC_RESTART_COUNT: attempts of one run share its run id
    host: str           # liveness.host_identity(): pids are comparable only on the same one
    hostname: str
    pid: int
    started: float      # epoch seconds

    @classmethod
    def here(cls, environ: dict[str, str] | None = None) -> Holder:
        env = os.environ if environ is None else environ
        try:
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError:
            restart = 0
        return cls(env.get("TORCHELASTIC_RUN_ID", ""), restart, host_identity(), socket.gethostname(), os.getpid(),
                   time.time())

    def same_run_later(self, earlier: Holder) -> bool:
        """Whether this is a later attempt (torchrun --max-restarts) of ``earlier``'s run."""
        return bool(self.run_id) and self.run_id == earlier.run_id and self.restart > earlier.restart

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds")
        run = f"run id {self.run_id}, " if self.run_id else ""
        return f"{run}host {self.hostname}, pid {self.pid}, since {since}"

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The record of a lock file (None when empty or not ours)."""
        try:
            data = json.loads(text)
            return cls(str(data["run_id"]), int(data["restart"]), str(data["host"]), str(data["hostname"]),
                       int(data["pid"]), float(data["started"]))
        except (ValueError, KeyError, TypeError):
            return None


def judge(prev: Holder | None, me: Holder, *, held: bool, alive: Callable[[int], bool]) -> tuple[bool, str]:
    """May ``me`` take the lock whose record is ``prev``, and the line to say (pure): ``held`` when
    another process holds the flock (or, without flocks, when a record is there). (True, "") for a
    free lock or one left by an earlier attempt of this run; (True, line) for a stale lock taken
    over; (False, why) for another job's."""
    if prev is None:
        return (False, "in use by a job that is just starting (its lock holds no record yet)") if held else (True, "")
    if not held:
        if me.same_run_later(prev):
            return True, ""
        return True, f"took over the lock of {prev.describe()}: that job ended without releasing it"
    if prev.host == me.host and not alive(prev.pid):
        return True, (f"took over the lock of {prev.describe()}: its process is gone from this host (a process it "
                      "left behind still holds the lock; it is claimed when that one exits)")
    if prev.host != me.host and me.same_run_later(prev):
        return True, (f"took over the lock of attempt {prev.restart} of this run ({prev.describe()}): its host is "
                      "gone and still holds the lock; it is claimed when the filesystem releases it")
    return False, f"in use by another job ({prev.describe()})"


class DirLock:
    """An acquired lock of one directory (see the module docstring)."""

    def __init__(self, fd: int, path: Path, me: Holder) -> None:
        self.fd, self.path, self.me = fd, path, me
        self._released = threading.Event()
        self.claimed = threading.Event()        # set once this process holds the flock itself

    @classmethod
    def acquire(cls, root: str | os.PathLike, me: Holder, *, alive: Callable[[int], bool] = process_alive,
                settle: float = 1.0) -> tuple[DirLock, str]:
        """Lock ``root`` for ``me`` or raise UserError naming the job that has it (nothing written
        then). ``settle``: how long to wait for the record of a lock that is held but empty."""
        path = Path(root) / LOCK_NAME
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode())
        except OSError as e:
            raise UserError(f"cannot lock --checkpoint-dir {root}: {path}: {e.strerror or e}") from None
        try:
            return cls._decide(fd, path, me, alive, settle)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _decide(cls, fd: int, path: Path, me: Holder, alive: Callable[[int], bool],
                settle: float) -> tuple[DirLock, str]:
        supported = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise UserError(f"cannot lock {path}: {e.strerror or e}") from None
            supported, held = False, True
        prev = _read(fd)
        deadline = time.monotonic() + settle
        while supported and held and prev is None and time.monotonic() < deadline:
            time.sleep(0.05)            # a job that just took the flock writes its record next
            prev = _read(fd)
        if not supported and prev is None:
            held = False
        ok, line = judge(prev, me, held=held, alive=alive)
        if not ok:
            hint = "" if supported else f" (this filesystem has no locks: if that job is gone, delete {path})"
            raise UserError(f"--checkpoint-dir {path.parent} is {line}: two jobs must never write one checkpoint "
                            f"directory; pass another --checkpoint-dir, or stop that job first{hint}")
        lock = cls(fd, path, me)
        try:
            lock._write()
        except OSError as e:
            raise UserError(f"cannot lock --checkpoint-dir {path.parent}: writing {path}: {e.strerror or e}") from None
        if not held:
            lock.claimed.set()
        if held and supported:          # a stale holder: claim the flock once it lets go
            threading.Thread(target=lock._claim, name="checkpoint-dir-lock", daemon=True).start()
        if not supported:
            line = "; ".join(x for x in (line, f"{path.parent}'s filesystem has no file locks: only the lock's record "
                                         "is checked, so two jobs started at the same instant are not told apart") if x)
        return lock, line

    def _write(self) -> None:
        data = json.dumps(asdict(self.me)).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def _claim(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            if not self._released.is_set():
                self._write()
                self.claimed.set()
        except OSError:
            pass

    def release(self) -> None:
        """Empty the record and let go (a clean end: the next job starts without a line)."""
        if self._released.is_set():
            return
        self._released.set()
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def lock_for_job(root: str | os.PathLike, rank: int, check: Callable[[], None] | None = None) -> DirLock | None:
    """Rank 0 locks ``root`` for the job (collective over the default group when there is one: every
    rank learns the outcome); its DirLock on rank 0, None elsewhere. UserError on every rank when
    another job has it (nothing written), or when ``check`` (run on rank 0 holding the lock) raises
    one (the lock released); a line on stderr when a stale lock was taken over."""
    lock, said = None, [None, ""]
    if rank == 0:
        try:
            lock, note = DirLock.acquire(root, Holder.here())
            said = [None, note]
            if check is not None:
                check()
        except UserError as e:
            said = [one_line(e), ""]
            if lock is not None:
                lock.release()
                lock = None
    if dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    if said[0] is not None:
        raise UserError(str(said[0]))
    if said[1] and rank == 0:
        print(f"hybridpipe: {said[1]}", file=sys.stderr, flush=True)
    return lock


class SaveLocks:
    """The checkpoint directories a Trainer saves into: the first save into one locks it for the
    job (:func:`lock_for_job`, collective) until :meth:`release`, and refuses one that holds
    checkpoints the trainer did not load (as launch without ``--resume``: a later load would take
    the newest of either run's). ``held``: a directory the job locked already (launch's)."""

    def __init__(self, rank: int, held: str | os.PathLike | None = None) -> None:
        self.rank = rank
        self.locks: dict[str, DirLock | None] = {} if held is None else {_key(held): None}
        self.read: set[str] = set()

    def loaded(self, root: str | os.PathLike) -> None:
        """``root``'s checkpoints were loaded: saving there continues them."""
        self.read.add(_key(root))

    def before_save(self, root: str | os.PathLike) -> None:
        if (key := _key(root)) in self.locks:
            return
        hint = "trainer.load(it) first to continue them, or save into an empty directory"
        self.locks[key] = lock_for_job(root, self.rank, None if key in self.read else
                                       lambda: check_fresh(root, named=str(root), hint=hint))

    def release(self) -> None:
        for lock in self.locks.values():
            if lock is not None:
                lock.release()
        self.locks.clear()


def _key(root: str | os.PathLike) -> str:
    return str(Path(root).resolve())


def _read(fd: int) -> Holder | None:
    try:
        return Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
    except OSError:
        return None
