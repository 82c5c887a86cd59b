"""``viasd demo``: greedy, HF assisted generation and VIA-SD on a built-in model pair, side by side in one run."""

from __future__ import annotations

import argparse
from pathlib import Path

from viasd_hf.bench.demo import BUDGET_SECONDS, DTYPES, MAX_NEW_TOKENS, run_demo
from viasd_hf.cli.args import UsageError, check_model, positive_int


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd demo``."""
    demo = subparsers.add_parser("demo", help="is VIA-SD faster here? greedy, HF assisted generation and VIA-SD, "
                                              "side by side on a built-in model pair")  # fmt: skip
    demo.add_argument("--small", action="store_true", help="SmolLM2-135M-Instruct with prompt lookup (seconds, not minutes)")
    demo.add_argument("--target", help="zoo name, Hub id or local folder (default: Qwen2.5-Coder-1.5B-Instruct)")
    demo.add_argument("--drafter", help="assistant model (default: Qwen2.5-Coder-0.5B-Instruct; none with --small)")
    demo.add_argument("--max-new-tokens", type=positive_int, default=MAX_NEW_TOKENS,
                      help=f"new tokens per prompt (default: {MAX_NEW_TOKENS})")
    demo.add_argument("--budget", type=float, default=BUDGET_SECONDS, metavar="SECONDS",
                      help=f"time the prompts in rounds (every method on one prompt) until about SECONDS are spent, two "
                           f"rounds at least (default: {BUDGET_SECONDS:.0f}; 0: every prompt)")
    demo.add_argument("--dtype", choices=DTYPES, default="auto",
                      help="the target's precision (default: auto, the faster of float32 and bf16 measured here)")
    demo.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    demo.set_defaults(handler=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    if args.json is not None and Path(args.json).expanduser().is_dir():
        raise UsageError(f"--json {args.json}: is a folder; give a file name")
    if args.json is not None and not Path(args.json).expanduser().resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: its folder does not exist")
    for flag, name in (("--target", args.target), ("--drafter", args.drafter)):
        if name is not None:
            check_model(name, flag)
    if not args.budget >= 0:
        raise UsageError(f"--budget must be 0 (every prompt) or a positive number of seconds, got {args.budget}")
    run_demo(small=args.small, target_name=args.target, drafter_name=args.drafter, max_new_tokens=args.max_new_tokens,
             dtype=args.dtype, json_path=args.json, budget=args.budget or None)  # fmt: skip
    return 0
