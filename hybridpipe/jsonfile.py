"""Reading and writing the project's versioned JSON files (profile, cluster, plan, calibration)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hybridpipe.errors import UserError


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Load ``path`` as JSON; a missing or unparsable file becomes a one-line UserError."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} file {p} does not exist") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} file {p}: {e.__class__.__name__}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (temp file + rename); creates parent folders."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def check_header(data: Any, kind: str, version: int, source: str) -> dict:
    """Check that ``data`` is a JSON object of ``kind`` at format ``version``; return it."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object holding a {kind}, got {type(data).__name__}")
    if data.get("kind") != kind:
        raise UserError(f"{source}: not a {kind} file (its \"kind\" is {data.get('kind')!r}); "
                        f"pass a file written by the hybridpipe command that makes {kind}s")
    if data.get("format") != version:
        raise UserError(f"{source}: {kind} format {data.get('format')!r} is not supported "
                        f"(this hybridpipe reads format {version}); regenerate the file")
    return data


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
               list: "a list", dict: "an object"}


def field(obj: dict, key: str, kind: type, where: str, *, minimum: float | None = None,
          default: Any = ..., choices: tuple | None = None) -> Any:
    """Fetch ``obj[key]`` checked against ``kind`` (int accepted for float; bool never for numbers).

    ``where`` names the place for the error message (e.g. "plan.json: stage 2").
    Without ``default`` the key is required.
    """
    if key not in obj:
        if default is ...:
            raise UserError(f"{where}: missing required field \"{key}\"")
        return default
    value = obj[key]
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise UserError(f"{where}: field \"{key}\" must be {_TYPE_NAMES.get(kind, kind.__name__)}, "
                        f"got {json.dumps(value)[:60]}")
    if kind is float and value != value or kind is float and value in (float("inf"), float("-inf")):
        raise UserError(f"{where}: field \"{key}\" must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise UserError(f"{where}: field \"{key}\" must be >= {minimum}, got {value}")
    if choices is not None and value not in choices:
        raise UserError(f"{where}: field \"{key}\" must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value
