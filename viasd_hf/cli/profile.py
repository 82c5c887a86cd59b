"""``viasd profile``: the cost of a slim forward relative to a full one, measured on this machine."""

from __future__ import annotations

import argparse

from ..masks import RoutingMask
from ..profiling import cost_ratios, evenly_spaced_skip, forward_seconds
from .args import DTYPES, check_model, load_model, positive_int, positive_ints, skip_fractions


def add_profile_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd profile``."""
    profile = subparsers.add_parser("profile", help="cost of a slim forward relative to a full one, on this machine")
    profile.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="zoo name, Hub id or local folder")
    profile.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    profile.add_argument("--skip-ratios", type=skip_fractions, default="0.25,0.45",
                         help="evenly spaced masks skipping these fractions")  # fmt: skip
    profile.add_argument("--context", type=positive_int, default=300, help="tokens already in the KV cache")
    profile.add_argument("--blocks", type=positive_ints, default="1,6", help="new tokens per timed forward")
    profile.add_argument("--repeats", type=positive_int, default=7)
    profile.set_defaults(handler=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    """Time full and evenly spaced slim forwards, and print their costs as a Markdown table."""
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
