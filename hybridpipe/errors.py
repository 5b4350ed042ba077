"""Errors a user can cause. The CLI and launch.py print them as one line and exit 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input (a file, an argument, a plan) rather than a bug.

    The message must say what is wrong and how to fix it; it is printed without a traceback.
    """


def require(condition: bool, message: str) -> None:
    """Raise ``UserError(message)`` unless ``condition`` holds."""
    if not condition:
        raise UserError(message)


class AgreedError(UserError):
    """A UserError that every rank of a job raises at the same point with the same message,
    agreed through a collective (no usable checkpoint, a non-finite loss): the failure guard
    prints it once per host and every rank exits 2, without blaming one of them."""


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` for a message, in English's regular plural: "1 micro-batch", "3 micro-batches", "2 nodes"."""
    return f"{n} {noun if n == 1 else noun + ('es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's')}"


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a UserError is one line by contract; this keeps a
    stray newline, e.g. from a library's text quoted inside it, off the terminal)."""
    text = "; ".join(x.strip() for x in str(exc).splitlines() if x.strip()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:1997] + "..."
