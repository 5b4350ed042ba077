"""The command-line options that choose a plan's schedule and its micro-batches per step, defined
once for every command that takes them (partition, autotune, schedule, simulate, launch)."""

from __future__ import annotations

import argparse

from hybridpipe.argtypes import positive_int
from hybridpipe.partitioner.schedule_registry import AUTO, REGISTRY, auto_candidates

ArgGroup = argparse._ActionsContainer      # a parser or an argument group (not search.options.Options)


def add_schedule_option(parser: ArgGroup, *, default: str | None = None, auto: bool = False) -> None:
    """``--schedule NAME``, one of the registry's schedules; ``default`` None: the plan's.
    ``auto``: also ``auto``, the partitioner's pick (``planner.partition``)."""
    help_text = f"pipeline schedule (default {default})" if default else "pipeline schedule (default: the plan's)"
    if auto:
        help_text += (f"; auto: the fastest simulated of {', '.join(auto_candidates())} (same updates as sequential "
                      "SGD) and, with --virtual-stages unset or auto (partition), of interleaved-1f1b and zbv with "
                      "the virtual stages searched too; with --virtual-stages V only V")
    parser.add_argument("--schedule", choices=(*REGISTRY, AUTO) if auto else tuple(REGISTRY), default=default,
                        help=help_text)


def add_micro_batches_option(parser: ArgGroup, *, default: str = "the plan's") -> None:
    """``--micro-batches M`` (a whole number >= 1); ``default`` says in words what none means."""
    parser.add_argument("--micro-batches", type=positive_int, metavar="M",
                        help=f"micro-batches per step (default: {default})")
