"""``viasd vocab``: build a pair's draft vocabulary and write it beside its routing mask's folder layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from viasd_hf.calibration.vocabulary import DEFAULT_SIZES, build_vocabulary
from viasd_hf.cli.args import (
    DTYPES,
    check_model,
    check_output_dir,
    load_model,
    non_negative_int,
    positive_int,
    positive_ints,
)


def add_vocab_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd vocab``."""
    vocab = subparsers.add_parser(
        "vocab", help="build a frequency-ranked draft vocabulary for the drafter and the slim verifier"
    )
    vocab.add_argument("--target", required=True, help="zoo name, Hub id or local folder")
    vocab.add_argument("--drafter", help="the drafter model (its head cost decides V); default: the target itself")
    vocab.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    vocab.add_argument("--per-family", type=positive_int, default=8, help="prompts counted per corpus family")
    vocab.add_argument("--heldout-per-family", type=positive_int, default=2,
                       help="held-out prompts per family, for coverage")  # fmt: skip
    vocab.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens of each greedy continuation")
    vocab.add_argument("--sizes", type=positive_ints, default=",".join(map(str, DEFAULT_SIZES)),
                       help="candidate vocabulary sizes V")  # fmt: skip
    vocab.add_argument("--block", type=positive_int, default=5, help="draft block length the choice of V assumes")
    vocab.add_argument("--seed", type=non_negative_int, default=0)
    vocab.add_argument("--out", type=Path, default=Path("vocabularies"),
                       help="root folder: writes <out>/<target>/<drafter folder>/draft_vocabulary.json (hub_masks "
                            "layout)")  # fmt: skip
    vocab.set_defaults(handler=run_vocab_command)


def run_vocab_command(args: argparse.Namespace) -> int:
    """Check the arguments, build the vocabulary, write it, and print coverage, head cost and score per candidate size."""
    check_model(args.target, "--target")
    if args.drafter:
        check_model(args.drafter, "--drafter")
    check_output_dir(args.out, "--out")
    target, tokenizer = load_model(args.target, args.dtype, "--target")
    drafter = load_model(args.drafter, args.dtype, "--drafter")[0] if args.drafter else None
    vocabulary = build_vocabulary(
        target, tokenizer, cost_model=drafter, drafter_id=args.drafter or "self", per_family=args.per_family,
        heldout_per_family=args.heldout_per_family, max_new_tokens=args.max_new_tokens, sizes=args.sizes,
        block=args.block, seed=args.seed,
    )  # fmt: skip
    path = vocabulary.save_pretrained(args.out / vocabulary.pair_folder)
    print(f"{path}: V = {vocabulary.size} of {vocabulary.vocab_size}; {vocabulary.counted}")
    print(f"| V | held-out coverage | pass cost ({vocabulary.cost_model_id}) | cost / coverage^{args.block} |")
    print("|---|---|---|---|")
    for size, covered in vocabulary.coverage.items():
        score = vocabulary.metadata["score"][size]
        print(f"| {size} | {covered:.4f} | {vocabulary.head_cost[size]:.3f} | {score:.3f} |")
    return 0
