"""The ``viasd`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from .bench.command import add_bench_command
from .cli_args import DTYPES, CommandError, check_model, positive_int, positive_ints, skip_fractions
from .dimr import add_search_command
from .hub import add_hub_commands


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="VIA-SD on a built-in model pair next to plain greedy, in one run")
    demo.add_argument("--small", action="store_true", help="SmolLM2-135M-Instruct with prompt lookup (seconds, not minutes)")
    demo.add_argument("--target", help="zoo name, Hub id or local folder (default: Qwen2.5-Coder-1.5B-Instruct)")
    demo.add_argument("--drafter", help="assistant model (default: Qwen2.5-Coder-0.5B-Instruct; none with --small)")
    demo.add_argument("--prompt", default="Write a Python function that reverses a string.")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16, float32 with --small)")
    demo.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(small=args.small, target_name=args.target, drafter_name=args.drafter, prompt=args.prompt,
             max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    return 0


def _add_profile(subparsers: argparse._SubParsersAction) -> None:
    profile = subparsers.add_parser("profile", help="cost of a slim forward relative to a full one, on this machine")
    profile.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="zoo name, Hub id or local folder")
    profile.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    profile.add_argument("--skip-ratios", type=skip_fractions, default="0.25,0.45",
                         help="evenly spaced masks skipping these fractions")
    profile.add_argument("--context", type=positive_int, default=300, help="tokens already in the KV cache")
    profile.add_argument("--blocks", type=positive_ints, default="1,6", help="new tokens per timed forward")
    profile.add_argument("--repeats", type=positive_int, default=7)
    profile.set_defaults(handler=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from .cli_args import load_model
    from .masks import RoutingMask
    from .profiling import cost_ratios, evenly_spaced_skip, forward_seconds

    check_model(args.target, "--target")
    model, _ = load_model(args.target, args.dtype, "--target")
    masks: dict[str, RoutingMask | None] = {"full": None}
    for ratio in args.skip_ratios:
        masks[f"slim {ratio:.0%}"] = RoutingMask.from_model(model, skip=evenly_spaced_skip(model, ratio))
    blocks = tuple(dict.fromkeys(args.blocks))
    seconds = forward_seconds(model, args.context, blocks, masks, repeats=args.repeats)
    ratios = cost_ratios(seconds)
    print(f"{args.target} ({args.dtype}), KV cache of {args.context} tokens; cost relative to one full 1-token forward")
    print("| forward | " + " | ".join(f"{n} new" for n in blocks) + " |")
    print("|---|" + "---|" * len(blocks))
    for label, per_block in ratios.items():
        cells = " | ".join(f"{per_block[n]:.2f} ({seconds[label][n] * 1000:.0f} ms)" for n in blocks)
        print(f"| {label} | {cells} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="viasd", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    add_bench_command(subparsers)
    _add_profile(subparsers)
    add_search_command(subparsers)
    add_hub_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a mistake in the arguments is one line on stderr and exit status 2, not a traceback."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0), or its usage and one error line (2)
        return exit_.code if isinstance(exit_.code, int) else 1
    try:
        return args.handler(args)
    except CommandError as error:
        print(f"viasd {args.command}: error: {error}", file=sys.stderr)
        return error.exit_status


if __name__ == "__main__":
    sys.exit(main())
