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
