"""The ``viasd`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from viasd_hf.cli.args import CommandError, first_line
from viasd_hf.cli.bench import add_bench_command
from viasd_hf.cli.demo import add_demo_command
from viasd_hf.cli.hub import add_hub_commands
from viasd_hf.cli.profile import add_profile_command
from viasd_hf.cli.replay import add_replay_command
from viasd_hf.cli.search import add_search_command
from viasd_hf.cli.vocab import add_vocab_command
from viasd_hf.extras import MissingExtraError, hide_assisted_generation_deprecation
from viasd_hf.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``viasd`` parser; the subcommands are listed in ``--help`` in this order."""
    parser = _Parser(prog="viasd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"viasd {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (default: one line)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_demo_command(subparsers)
    add_bench_command(subparsers)
    add_profile_command(subparsers)
    add_replay_command(subparsers)
    add_search_command(subparsers)
    add_hub_commands(subparsers)
    add_vocab_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a mistake in the arguments is one line on stderr and exit status 2, not a traceback, and a
    failure during the run (an optional package the subcommand needs and lacks, a model that will not load) one line
    and exit status 1; ``--debug`` shows a failure's traceback instead."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0), or its usage and one error line (2)
        return exit_.code if isinstance(exit_.code, int) else 1
    hide_assisted_generation_deprecation()  # demo and bench run HF assisted generation, which warns about itself
    try:
        return args.handler(args)
    except CommandError as error:
        print(f"viasd {args.command}: error: {error}", file=sys.stderr)
        return error.exit_status
    except MissingExtraError as error:
        print(f"viasd {args.command}: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if args.debug:
            raise
        print(f"viasd {args.command}: error: {first_line(error)} (--debug shows where)", file=sys.stderr)
        return 1
