"""``viasd demo``: VIA-SD on a built-in model pair next to plain greedy, in one run."""

from __future__ import annotations

import argparse

from ..demo import run_demo


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd demo``."""
    demo = subparsers.add_parser("demo", help="VIA-SD on a built-in model pair next to plain greedy, in one run")
    demo.add_argument("--small", action="store_true", help="SmolLM2-135M-Instruct with prompt lookup (seconds, not minutes)")
    demo.add_argument("--target", help="zoo name, Hub id or local folder (default: Qwen2.5-Coder-1.5B-Instruct)")
    demo.add_argument("--drafter", help="assistant model (default: Qwen2.5-Coder-0.5B-Instruct; none with --small)")
    demo.add_argument("--prompt", default="Write a Python function that reverses a string.")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16, float32 with --small)")
    demo.set_defaults(handler=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    run_demo(small=args.small, target_name=args.target, drafter_name=args.drafter, prompt=args.prompt,
             max_new_tokens=args.max_new_tokens, dtype=args.dtype)  # fmt: skip
    return 0
