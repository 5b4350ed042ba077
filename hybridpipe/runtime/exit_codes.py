"""The exit codes of a worker process (failure.py ends the process with them; launch.py returns them).

* :data:`EXIT_PEER_LOST` (75, ``os.EX_TEMPFAIL``): another rank failed, this one is fine: retry
  (``torchrun --max-restarts`` with ``--resume`` goes on).
* :data:`EXIT_ERROR` (1): this rank failed (its traceback printed).
* :data:`EXIT_USER_ERROR` (2): a UserError (one line), or an AgreedError every rank raised together.
* :data:`EXIT_SIGTERM` (143) / :data:`EXIT_INTERRUPT` (130): the job was stopped by SIGTERM / SIGINT.
"""

from __future__ import annotations

import signal

EXIT_PEER_LOST = 75
EXIT_ERROR = 1
EXIT_USER_ERROR = 2
EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_INTERRUPT = 130

__all__ = ["EXIT_PEER_LOST", "EXIT_ERROR", "EXIT_USER_ERROR", "EXIT_SIGTERM", "EXIT_INTERRUPT"]
