"""The ``hybridpipe`` command. Each subcommand lives in ``hybridpipe/commands/<name>.py`` with
``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one is imported, so
``hybridpipe --help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hybridpipe.argtypes import Parser
from hybridpipe.errors import UserError, one_line

# (name, module under hybridpipe.commands, one-line help)
COMMANDS = (
    ("profile", "profile", "trace a model and measure every node (forward, backward, bytes)"),
    ("show", "show", "print a profile, plan or calibration file as a table"),
    ("partition", "partition", "split a profiled model into stages x replicas for a cluster"),
    ("autotune", "autotune", "plan, run briefly, refine the model from the run, re-plan; keep the fastest"),
    ("import-pipedream", "import_pipedream", "convert a PipeDream profile (graph.txt) to a hybridpipe profile"),
    ("simulate", "simulate", "predict a plan's step time with an event-driven simulation"),
    ("schedule", "schedule", "print or draw a plan's per-rank instruction lists"),
    ("bench-allreduce", "bench_allreduce", "measure every all-reduce algorithm; write a calibration"),
    ("aggregator", "aggregator", "run a dedicated all-reduce aggregator process (seed 001)"),
    ("timeline", "timeline", "merge the ranks' traces of a run into one Chrome trace and PNG"),
    ("merge-checkpoint", "merge_checkpoint", "join a run's stage checkpoints into one state_dict"),
)


def _top_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="hybridpipe",
        description="Pipelined hybrid-parallel training for PyTorch: profile -> partition -> launch.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<18}{h}" for n, _, h in COMMANDS)
        + "\n\nrun `hybridpipe COMMAND --help` for a command's options; "
          "training runs under torchrun: `torchrun ... -m hybridpipe.launch --plan plan.json`")
    p.add_argument("command", choices=[n for n, _, _ in COMMANDS], metavar="COMMAND")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return p


def command_parser(name: str):
    """(the command's module, its argument parser) for ``name``; None when not in this build."""
    module_name, help_text = next((m, h) for n, m, h in COMMANDS if n == name)
    try:
        module = importlib.import_module(f"hybridpipe.commands.{module_name}")
    except ModuleNotFoundError as e:
        if e.name != f"hybridpipe.commands.{module_name}":
            raise
        return None
    parser = Parser(prog=f"hybridpipe {name}", description=help_text)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    module.add_arguments(parser)
    return module, parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridpipe`` console script; returns the exit code.

    ``-v`` may come before or after the command name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    verbose = bool(argv) and argv[0] in ("-v", "--verbose")
    if verbose:
        argv = argv[1:]
    try:
        if not argv or argv[0].startswith("-"):
            top.parse_args(argv or ["--help"])
            return 2
        top.parse_args(argv[:1])  # validates the command name
        name = argv[0]
        found = command_parser(name)
        if found is None:
            print(f"hybridpipe {name}: not available in this build", file=sys.stderr)
            return 2
        module, parser = found
        rest: list[str] = []
        if getattr(module, "TAKES_COMMAND", False) and "--" in argv:    # autotune ... -- the job's own command
            cut = argv.index("--")
            argv, rest = argv[:cut], argv[cut + 1:]
        args = parser.parse_args(argv[1:])
        if getattr(module, "TAKES_COMMAND", False):
            args.command = rest
    except SystemExit as e:         # --help (0) or a bad argument (2, one line already printed)
        return e.code if isinstance(e.code, int) else 2
    verbose = verbose or args.verbose
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        print(f"hybridpipe {name}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridpipe {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
