"""Reading and writing the project's JSON files (profile, cluster, plan, calibration, manifests).

One loader for every file a user hands in (:func:`read_json`: missing, unreadable, a symlink
loop, not JSON, nested absurdly deep -> one-line UserError), typed field access that names the
field (:func:`field`), and the project's one atomic write (:func:`atomic_file`, under
:func:`write_json`, the checkpoints and the timelines) whose files get the user's umask like any
other program's (``0644`` by default), not ``mkstemp``'s ``0600``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from hybridpipe.errors import UserError

MAX_DEPTH = 64          # our formats nest 6 deep; anything past this is not one of them
# the largest figure (ms, bytes, Gbit/s, us, GB, a slowdown factor) a profile, cluster, calibration
# or plan may hold: 1e15 ms is 31,000 years, 1e15 bytes a petabyte. Sums and products of such
# figures over a million nodes, workers and micro-batches stay far inside a float (1e308), so the
# partitioner's searches compare real numbers and end; 1e308 in a profile made them overflow to
# inf and nan and search for ever.
MAX_FIGURE = 1e15
# the largest figure a plan may hold: the partitioner's sums of input figures (a stage's time over
# its nodes and micro-batches) reach past MAX_FIGURE, and a plan it writes must read back
MAX_PLAN_FIGURE = 1e100


def read_json(path: str | os.PathLike, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Load ``path`` as JSON; a missing, unreadable or unparsable file becomes a one-line UserError."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} file {p} does not exist") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {p} is not text (UTF-8): {e.reason} at byte {e.start}") from None
    except OSError as e:        # a directory, no permission, a symlink loop, an I/O error
        raise UserError(f"cannot read {what} file {p}: {e.strerror or e}") from None
    return parse_json(text, f"{what} file {p}", max_depth=max_depth)


def parse_json(text: str, source: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with the defects a user can hand in turned into one-line UserErrors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{source} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise UserError(f"{source} is nested too deeply to be a hybridpipe file") from None
    except ValueError as e:     # e.g. an integer of more digits than Python converts
        raise UserError(f"{source} is not valid JSON ({e})") from None
    depth = json_depth(data, max_depth + 1)
    if depth > max_depth:
        raise UserError(f"{source} is nested more than {max_depth} levels deep: not a hybridpipe file")
    return data


def json_depth(data: Any, stop: int) -> int:
    """Nesting depth of lists and objects in ``data`` (a scalar is 0), counted up to ``stop``."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if level >= stop:
                return deepest
            todo.extend((x, level + 1) for x in (item.values() if isinstance(item, dict) else item))
    return deepest


def file_mode() -> int:
    """The mode a new file gets under this process's umask (``0o666 & ~umask``)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)     # no /proc: read it the old way (and put it back)
        os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, durable: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` atomically: the block writes a temporary file beside it, which then gets the
    user's umask and is renamed onto ``path``; with ``durable`` (checkpoints) the file and then its
    directory are fsynced. Parent folders are created; an OSError is a one-line UserError ("cannot
    write PATH: reason"); on any error the temporary file is removed and ``path`` is untouched."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise UserError(f"cannot write {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        replace_into(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {p}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(p.parent)


def replace_into(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give a finished temporary file the user's mode and rename it onto ``path`` (atomic); for
    files another library writes by name (:func:`atomic_file` otherwise)."""
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (where the filesystem allows fsync on a directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:         # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (:func:`atomic_file`)."""
    return write_text(path, json.dumps(data, indent=1) + "\n")


def check_header(data: Any, kind: str, version: int, source: str) -> dict:
    """Check that ``data`` is a JSON object of ``kind`` at format ``version``; return it."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object holding a {kind}, got {_json_type(data)}")
    if data.get("kind") != kind:
        raise UserError(f"{source}: not a {kind} file (its \"kind\" is {short_json(data.get('kind'))}); "
                        f"pass a file written by the hybridpipe command that makes {kind}s")
    if data.get("format") != version:
        raise UserError(f"{source}: {kind} format {short_json(data.get('format'))} is not supported "
                        f"(this hybridpipe reads format {version}); regenerate the file")
    return data


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
               list: "a list", dict: "an object"}


def _json_type(value: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def short_json(value: Any) -> str:
    """``value`` as JSON (a user's own spelling of it), cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _as_float(value: int | float) -> float:
    """``float(value)``, with integers too large for a float as infinities (not OverflowError)."""
    if isinstance(value, float):
        return value
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def field(obj: dict, key: str, kind: type, where: str, *, minimum: float | None = None,
          maximum: float | None = None, default: Any = ..., choices: tuple | None = None,
          items: type | None = None) -> Any:
    """Fetch ``obj[key]`` checked against ``kind`` (int accepted for float; bool never for numbers;
    floats must be finite). ``items``: the type every element of a list must have.

    ``where`` names the place for the error message (e.g. "plan.json: stage 2").
    Without ``default`` the key is required.
    """
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object, got {_json_type(obj)}")
    if key not in obj:
        if default is ...:
            raise UserError(f"{where}: missing required field \"{key}\"")
        return default
    value = obj[key]
    if not _is(value, kind):
        raise UserError(f"{where}: field \"{key}\" must be {_TYPE_NAMES.get(kind, kind.__name__)}, "
                        f"got {short_json(value)}")
    if kind is float:
        value = _as_float(value)
        if not math.isfinite(value):
            raise UserError(f"{where}: field \"{key}\" must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise UserError(f"{where}: field \"{key}\" must be >= {minimum:g}, got {short_json(value)}")
    if maximum is not None and value > maximum:
        raise UserError(f"{where}: field \"{key}\" must be <= {maximum:g}, got {short_json(value)}")
    if choices is not None and value not in choices:
        raise UserError(f"{where}: field \"{key}\" must be one of {', '.join(map(str, choices))}; "
                        f"got {short_json(value)}")
    if items is not None:
        bad = next((x for x in value if not _is(x, items)), ...)
        if bad is not ...:
            raise UserError(f"{where}: every element of \"{key}\" must be {_TYPE_NAMES.get(items, items.__name__)}, "
                            f"got {short_json(bad)}")
        if items is float:
            value = [_as_float(x) for x in value]
            if not all(math.isfinite(x) for x in value):
                raise UserError(f"{where}: every element of \"{key}\" must be a finite number")
    return value


def figure(obj: dict, key: str, kind: type, where: str, *, minimum: float = 0, maximum: float = MAX_FIGURE,
           default: Any = ...) -> Any:
    """:func:`field` for a measured or predicted figure: a number from ``minimum`` to ``maximum``
    (:data:`MAX_FIGURE`; a plan's: :data:`MAX_PLAN_FIGURE`)."""
    return field(obj, key, kind, where, minimum=minimum, maximum=maximum, default=default)
