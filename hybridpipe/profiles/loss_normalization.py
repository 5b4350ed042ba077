"""The loss normalizations by name (profiles/losses.py says what each does) and which schedules can
run them: apart from the loss code, so that what only names or checks them (the plan, the
partition command) needs no torch."""

from __future__ import annotations

from hybridpipe.errors import UserError

LOSS_NORMALIZATIONS = ("micro-batch", "tokens")


def check_normalization(normalization: str, schedule_flushed: bool, schedule: str) -> None:
    """Refuse (one line) a normalization the schedule cannot run."""
    if normalization not in LOSS_NORMALIZATIONS:
        raise UserError(f"unknown loss normalization {normalization!r}; choose {' or '.join(LOSS_NORMALIZATIONS)}")
    if normalization == "tokens" and not schedule_flushed:
        raise UserError(f"--loss-normalization tokens divides the step's summed gradients by its token count at one "
                        f"global step, and {schedule} updates each stage after each micro-batch; use --schedule "
                        "1f1b, gpipe, zb-h1 or another flushed schedule, or --loss-normalization micro-batch")


__all__ = ["LOSS_NORMALIZATIONS", "check_normalization"]
