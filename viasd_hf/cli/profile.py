"""``viasd profile``: the cost of a slim forward relative to a full one, or (``--precision``) which form a model
runs fastest in, measured on this machine."""

from __future__ import annotations

import argparse

from viasd_hf.cli.args import (
    DTYPES,
    CommandError,
    UsageError,
    check_model,
    first_line,
    load_model,
    positive_int,
    positive_ints,
    skip_fractions,
)
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models import zoo
from viasd_hf.models.profiling import cost_ratios, evenly_spaced_skip, forward_seconds
from viasd_hf.models.quantization import AUTO, QuantizationChoice, markdown_table, resolve_dtype, resolve_quantization


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
    profile.add_argument("--precision", action="store_true",
                         help="instead: the forms --target was measured in on this machine and the one dtype=auto "
                              "picks (measured on first use, then read from the cache)")
    profile.add_argument("--draft-for", metavar="TARGET",
                         help="with --precision: --target drafts for TARGET, so every form is measured and judged by "
                              "TARGET, as --quantize drafter=auto chooses")
    profile.set_defaults(handler=run_profile_command)


def _precision_choice(args: argparse.Namespace) -> QuantizationChoice:
    try:
        if args.draft_for:
            return resolve_quantization(args.target, AUTO, draft_for=args.draft_for)
        return resolve_dtype(args.target)
    except (OSError, ValueError, zoo.ZooError) as error:
        raise CommandError(f"--target {args.target}: could not measure the model: {first_line(error)}") from error


def print_precision(args: argparse.Namespace) -> int:
    """The table the precision choice for --target rests on, and the choice."""
    choice = _precision_choice(args)
    print(markdown_table(choice.measurements))
    print(f"\nauto → {choice.scheme.name}: {choice.reason}")
    return 0


def run_profile_command(args: argparse.Namespace) -> int:
    """Time full and evenly spaced slim forwards, and print their costs as a Markdown table (or, with --precision,
    the precision table)."""
    check_model(args.target, "--target")
    if args.draft_for:
        if not args.precision:
            raise UsageError("--draft-for: only with --precision")
        check_model(args.draft_for, "--draft-for")
    if args.precision:
        return print_precision(args)
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
