"""The ``viasd`` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from .dimr import add_search_command
from .hub import add_hub_commands


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


def _add_speed(subparsers: argparse._SubParsersAction) -> None:
    speed = subparsers.add_parser("speed", help="tokens/s of greedy, HF assisted, two-tier and VIA-SD, side by side")
    speed.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    speed.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct")
    speed.add_argument("--mask", help="routing mask folder / JSON (default: the known mask of the pair, else --skip)")
    speed.add_argument("--skip", help="comma-separated layers to skip instead of a mask")
    speed.add_argument("--prompts", type=int, default=6, help="how many Spec-Bench prompts")
    speed.add_argument("--per-category", type=int, default=1, help="prompts taken from each Spec-Bench category")
    speed.add_argument("--max-new-tokens", type=int, default=64)
    speed.add_argument("--dtype", default="bfloat16")
    speed.add_argument("--methods", help="comma-separated subset of greedy,hf_assisted,two_tier,viasd,viasd_static,"
                       "viasd_lossless")
    speed.add_argument("--gamma", type=int, default=5, help="draft tokens per block for the VIA-SD variants")
    speed.add_argument("--draft-threshold", type=float, default=0.4, help="stop drafting below this drafter confidence")
    speed.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    speed.add_argument("--temperature", type=float, help="sample at this temperature (every method) instead of greedy")
    speed.add_argument("--json", help="write the summary here")
    speed.set_defaults(handler=_run_speed)


def _run_speed(args: argparse.Namespace) -> int:
    import json

    import torch

    from .demo import demo_mask
    from .masks import RoutingMask
    from .models import load_pretrained
    from .speed import compare_speed, load_categorised_prompts, markdown

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_pretrained(args.target, dtype=args.dtype)
    drafter, _ = load_pretrained(args.drafter, dtype=args.dtype)
    if args.mask:
        mask = RoutingMask.from_pretrained(args.mask)
    elif not args.skip:
        mask, _ = demo_mask(target, args.target, args.drafter)
    else:
        skip = [int(layer) for layer in args.skip.split(",")]
        mask = RoutingMask.from_model(target, skip=skip, drafter_id=args.drafter)
    categories, prompts = zip(*load_categorised_prompts(limit=args.prompts, per_category=args.per_category))
    methods = args.methods.split(",") if args.methods else None
    drafting = {"num_draft_tokens": args.gamma, "draft_confidence_threshold": args.draft_threshold}
    summary = compare_speed(
        target, tokenizer, drafter, mask, list(prompts), args.max_new_tokens, methods, drafting, args.temperature,
        list(categories),
    )
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args) | {"handler": None}, "mask": mask.to_dict(), "methods": summary}, handle, indent=2)
    return 0


def _add_profile(subparsers: argparse._SubParsersAction) -> None:
    profile = subparsers.add_parser("profile", help="cost of a slim forward relative to a full one, on this machine")
    profile.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    profile.add_argument("--dtype", default="bfloat16")
    profile.add_argument("--skip-ratios", default="0.25,0.45", help="evenly spaced masks skipping these fractions")
    profile.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    profile.add_argument("--blocks", default="1,6", help="new tokens per timed forward")
    profile.add_argument("--repeats", type=int, default=7)
    profile.set_defaults(handler=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from .masks import RoutingMask
    from .models import load_pretrained
    from .profiling import cost_ratios, evenly_spaced_skip, forward_seconds

    model, _ = load_pretrained(args.target, dtype=args.dtype)
    masks: dict[str, RoutingMask | None] = {"full": None}
    for ratio in (float(r) for r in args.skip_ratios.split(",")):
        masks[f"slim {ratio:.0%}"] = RoutingMask.from_model(model, skip=evenly_spaced_skip(model, ratio))
    blocks = tuple(int(n) for n in args.blocks.split(","))
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
    parser = argparse.ArgumentParser(prog="viasd", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    _add_speed(subparsers)
    _add_profile(subparsers)
    add_search_command(subparsers)
    add_hub_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
