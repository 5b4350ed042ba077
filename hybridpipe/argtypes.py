"""Checking what a user types, where it enters: argparse types and output paths.

Every command (and launch) builds its parser with :class:`Parser` (a bad argument is ONE line,
``prog: error: ...``, exit 2) and gives each number a type from here, so a range, a finiteness or
a limit is checked once, before any work::

    p.add_argument("--steps", type=positive_int)
    p.add_argument("--lr", type=positive_float)             # finite and > 0: nan, inf, 0 refused
    p.add_argument("--seed", type=seed)
    p.add_argument("-o", "--output", type=output_file)      # "cannot write X: reason" at once

:func:`check_output_file` / :func:`check_output_dir` are the same checks for paths that are
not arguments (a default output name, a run directory chosen at run time). They leave
nothing behind: a probe file in the target's directory or, when the directory does not exist
yet, a probe folder in its nearest existing ancestor (each removed at once).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_FIGURE

MAX_SEED = 2 ** 63 - 1
MAX_TIMEOUT_S = 1e6         # about 11.5 days; datetime.timedelta overflows far above
MIN_TIMEOUT_S = 1.0         # below this, joining a job or one transfer cannot finish


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ... (see prog --help)``), exit 2;
    with ``raise_errors`` set, a UserError with that text instead (launch shares it with every
    rank before anyone exits)."""

    raise_errors = False

    def error(self, message: str):
        if self.raise_errors:
            raise UserError(f"{message} (see {self.prog} --help)")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        want = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_range(low: int | None = None, high: int | None = None, *, cap: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in ``low..high`` (either end open when None); ``cap``: an
    upper bound named only when it is passed (a count's sanity bound, not part of its meaning)."""
    def parse(text: str) -> int:
        value = int(_number(text, int))
        if low is not None and value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high)}, got {value}")
        if cap is not None and value > cap:
            raise argparse.ArgumentTypeError(f"must be at most {cap:.0e} (a count past any real job's), got {value}")
        return value
    parse.__name__ = "int"
    return parse


def float_range(low: float | None = None, high: float | None = None, *, above: float | None = None
                ) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (or > ``above``) and <= ``high``."""
    def parse(text: str) -> float:
        value = _number(text, float)
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be greater than {above:g}, got {value:g}")
        if low is not None and value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be {_range_text(low, high)}, got {value:g}")
        return value
    parse.__name__ = "float"
    return parse


def _range_text(low: float | None, high: float | None) -> str:
    def show(x: float | None) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"
    if low is not None and high is not None:
        return f"between {show(low)} and {show(high)}"
    return f">= {show(low)}" if low is not None else f"<= {show(high)}"


# counts (steps, micro-batches, workers, ...) stay within the figures a file may hold, so the
# partitioner's and simulator's sums of them stay numbers (1e20 micro-batches overflowed numpy's int64)
MAX_COUNT = int(MAX_FIGURE)
positive_int = int_range(1, cap=MAX_COUNT)
nonneg_int = int_range(0, cap=MAX_COUNT)
positive_float = float_range(above=0.0)
nonneg_float = float_range(0.0)
finite_float = float_range()
seed = int_range(0, MAX_SEED)
port = int_range(0, 65535)
timeout_s = float_range(MIN_TIMEOUT_S, MAX_TIMEOUT_S)
memory_gb = float_range(above=0.0, high=MAX_FIGURE)     # as a cluster file's memory_gb


def host_port(text: str) -> str:
    """An argparse type: ``HOST:PORT`` with a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 1..65535), got {text!r}")
    return text


def check_output_file(path: str | os.PathLike, what: str = "") -> Path:
    """UserError "cannot write X: reason" unless a file can be written at ``path``; creates nothing."""
    p = Path(path)
    label = f"{what} {p}".strip()
    try:
        if p.is_dir() or p.name in ("", ".", ".."):
            raise UserError(f"cannot write {label}: it is a directory; name a file")
        _check_parent(p.parent if str(p.parent) else Path("."), label)
    except OSError as e:
        raise UserError(f"cannot write {label}: {e.strerror or e}") from None
    return p


def check_output_dir(path: str | os.PathLike, what: str = "") -> Path:
    """UserError "cannot write X: reason" unless files can be created in directory ``path``
    (existing, or creatable); creates nothing."""
    p = Path(path)
    label = f"{what} {p}".strip()
    try:
        if p.exists() and not p.is_dir():
            raise UserError(f"cannot write to {label}: it is a file, not a directory")
        if p.is_dir():
            _probe(p, label)
        else:
            _check_parent(p, label)
    except OSError as e:
        raise UserError(f"cannot write to {label}: {e.strerror or e}") from None
    return p


def _check_parent(directory: Path, label: str) -> None:
    """Files can be created in ``directory``, or it can be made (its nearest existing ancestor)."""
    if directory.is_dir():
        _probe(directory, label)
        return
    ancestor = directory
    while not ancestor.exists():
        if ancestor.is_symlink():
            raise UserError(f"cannot write {label}: {ancestor} is a broken symbolic link")
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"cannot write {label}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {label}: no permission to create folders in {ancestor}")
    # permissions are not the whole story: /proc, /sys, a read-only mount refuse even root
    try:
        probe = Path(tempfile.mkdtemp(prefix=".hybridpipe-probe-", dir=ancestor))
    except OSError as e:
        raise UserError(f"cannot write {label}: cannot create folders in {ancestor} "
                        f"({e.strerror or e})") from None
    probe.rmdir()


def _probe(directory: Path, label: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".hybridpipe-probe-", dir=directory)
    except OSError as e:
        raise UserError(f"cannot write {label}: {e.strerror or e} (in {directory})") from None
    os.close(fd)
    os.unlink(name)


def output_file(text: str) -> str:
    """An argparse type: a file path that can be written (see :func:`check_output_file`)."""
    try:
        check_output_file(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory that can be written into (see :func:`check_output_dir`)."""
    try:
        check_output_dir(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_path(text: str) -> str:
    """An argparse type: a file or a directory (which one is decided later, e.g. by ``--format``)
    that can be written: an existing directory files can be created in, or a file path."""
    try:
        try:
            is_dir = Path(text).is_dir()
        except OSError:             # a name too long: check_output_file says so
            is_dir = False
        if is_dir:
            check_output_dir(text)
        else:
            check_output_file(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
