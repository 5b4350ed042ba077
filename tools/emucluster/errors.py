"""Errors of the emulated cluster; all are user errors (one clear line, exit 2 on the CLI)."""

from __future__ import annotations

from hybridpipe.errors import UserError


class EmuClusterError(UserError):
    """The emulated cluster cannot be built, found or used; the message says how to fix it."""


class HostCommandFailed(EmuClusterError):
    """A command run on the emulated hosts failed or ran past its timeout."""

    def __init__(self, message: str, results: list) -> None:
        super().__init__(message)
        self.results = results
