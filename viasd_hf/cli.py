"""The ``viasd`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run the slim verifier on a built-in model and report what it saves")
    demo.add_argument("--small", action="store_true", help="use SmolLM2-135M-Instruct (fast) instead of Qwen2.5-Coder-1.5B")
    demo.add_argument("--model", help="zoo name, Hub id or local folder (overrides --small)")
    demo.add_argument("--prompt", default="Write a Python function that reverses a string.")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--skip", help="comma-separated decoder layers for the slim verifier to skip")
    demo.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 for the 1.5B, float32 otherwise)")
    demo.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    skip = [int(layer) for layer in args.skip.split(",")] if args.skip else None
    run_demo(model_name=args.model, small=args.small, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
             skip=skip, dtype=args.dtype)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="viasd", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
