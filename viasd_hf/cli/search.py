"""``viasd search``: find a routing mask with DIMR and save it with its search log and the command that made it."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..calibration import build_calibration, read_prompts, spec_bench_prompts
from ..dimr import OBJECTIVES, search
from ..mask_repo import MODEL_FREE
from .args import (
    DTYPES,
    UsageError,
    check_input_file,
    check_model,
    check_output_dir,
    first_line,
    load_model,
    non_negative_int,
    positive_float,
    positive_int,
    skip_fractions,
)

# The options ``search_command_line`` spells out, in order, so that a saved mask says how to redo it.
_FLAGS = ("target", "drafter", "skip_ratio", "objective", "iterations", "bo_every", "patience", "time_budget", "seed",
          "prompts", "num_prompts", "num_heldout", "window", "max_prompt_tokens", "dtype", "out")  # fmt: skip


def _skip_ratios(text: str) -> float | list[float]:
    """One ratio searches one budget; a comma list (even of one) sweeps budgets."""
    values = skip_fractions(text)  # argparse reports a bad value as one line
    return values[0] if len(values) == 1 and "," not in text else values


def _slug(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


def add_search_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``viasd search``: find a routing mask with DIMR and save it with its search log."""
    parser = subparsers.add_parser(
        "search",
        help="find the slim verifier's routing mask for a target (and drafter) with DIMR",
        description="Search which decoder layers the slim verifier skips (DIMR), then save routing_mask.json "
        "and search_log.jsonl to --out.",
    )
    parser.add_argument("--target", required=True, help="zoo name, Hub id or local folder")
    parser.add_argument("--drafter", help="drafter sharing the target's tokenizer (enables the Δ criterion); default: self")
    parser.add_argument("--skip-ratio", type=_skip_ratios, default=0.45,
                        help="fraction of layers to skip; a comma list (e.g. 0.1,0.15,0.2) sweeps budgets and keeps "
                        "the best predicted speed-up")  # fmt: skip
    parser.add_argument("--objective", choices=OBJECTIVES, default="via", help="via (KL-margin cost), kl, or top1")
    parser.add_argument("--iterations", type=positive_int, default=100, help="max masks evaluated per budget")
    parser.add_argument("--bo-every", type=positive_int, default=2,
                        help="propose by Bayesian optimisation when iteration %% N == 0")  # fmt: skip
    parser.add_argument("--patience", type=positive_int, default=30,
                        help="stop a budget after N evaluations without improvement")  # fmt: skip
    parser.add_argument("--time-budget", type=positive_float, help="seconds for the whole search (all budgets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", help="JSONL with a 'prompt' field, or text with one prompt per line (default: Spec-Bench)")
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="calibration prompts")
    parser.add_argument("--num-heldout", type=non_negative_int, default=16, help="held-out prompts (disjoint) for agreement")
    parser.add_argument("--window", type=positive_int, default=16, help="greedy continuation tokens scored per prompt (τ)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="the deployment dtype (costs are measured in it)")  # fmt: skip
    parser.add_argument("--out", help="output folder (default: masks/<target>/<drafter or self>)")
    parser.set_defaults(handler=run_search_command)
    return parser


def search_command_line(args: argparse.Namespace) -> str:
    """The ``viasd search`` command that reproduces ``args`` (every option spelled out)."""
    parts = ["viasd", "search"]
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(f"{v:g}" for v in value)
        parts += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def _check_search_args(args: argparse.Namespace) -> None:
    """What can be checked before the models load (minutes): models, the output folder, the prompts and their number."""
    check_model(args.target, "--target")
    if args.drafter not in (None, "self"):
        check_model(args.drafter, "--drafter")
    check_output_dir(args.out, "--out")
    source = f"--prompts {args.prompts}" if args.prompts else "the default Spec-Bench prompts"
    try:
        pool = read_prompts(check_input_file(args.prompts, "--prompts")) if args.prompts else spec_bench_prompts()
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        if isinstance(error, IndexError):
            reason = "no prompts in the file"
        elif isinstance(error, KeyError):
            reason = f"a record has no {error} field (JSONL prompts need 'prompt')"
        else:
            reason = first_line(error)
        raise UsageError(f"{source}: {reason}") from None
    if len(pool) < args.num_prompts + args.num_heldout:
        raise UsageError(
            f"{source}: {len(pool)} prompts, fewer than --num-prompts {args.num_prompts} + --num-heldout "
            f"{args.num_heldout}"
        )


def run_search_command(args: argparse.Namespace) -> int:
    """Check the arguments, load the models, build the calibration, search, and print a one-line summary."""
    drafted = args.drafter not in (None, "self")  # `--drafter self` is the default: the target drafts for itself
    args.out = args.out or str(Path("masks") / _slug(args.target) / (_slug(args.drafter) if drafted else MODEL_FREE))
    _check_search_args(args)
    target, tokenizer = load_model(args.target, args.dtype, "--target")
    drafter = load_model(args.drafter, args.dtype, "--drafter")[0] if drafted else None
    calibration = build_calibration(
        target, tokenizer, prompts=args.prompts, num_prompts=args.num_prompts, num_heldout=args.num_heldout,
        window=args.window, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
    )  # fmt: skip
    mask = search(
        target, drafter, calibration, skip_ratio=args.skip_ratio, objective=args.objective, iterations=args.iterations,
        bo_every=args.bo_every, patience=args.patience, time_budget=args.time_budget, seed=args.seed,
        out_dir=args.out, search_command=search_command_line(args),
    )  # fmt: skip
    heldout = mask.metadata.get("heldout") or {}
    print(
        f"skip {mask.skipped_layers} of {mask.num_layers} layers; {mask.objective} = {mask.objective_value:.4f}; "
        f"held-out top-1 {heldout.get('top1', float('nan')):.3f}, KL {heldout.get('kl', float('nan')):.3f}; "
        f"{mask.metadata['masks_evaluated']} masks in {mask.search_time_s:.0f}s -> {args.out}"
    )
    return 0
