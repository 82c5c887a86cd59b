"""``viasd search``: find a routing mask with DIMR and save it with its search log and the command that made it.

By default the mask lands in the user's masks folder (``viasd_hf.masks.repo.user_masks_dir``), where
the next ``generate`` for the pair finds it with no flag.
"""

from __future__ import annotations

import argparse
import shlex

from viasd_hf.calibration.corpus import (
    DEFAULT_DEPTHS,
    DEFAULT_SEED,
    DEFAULT_SIZES,
    corpus_calibration,
    stratified_corpus,
)
from viasd_hf.calibration.windows import build_calibration, read_prompts, spec_bench_prompts
from viasd_hf.cli.args import (
    DTYPES,
    UsageError,
    check_input_file,
    check_model,
    check_output_dir,
    first_line,
    load_model,
    non_negative_int,
    non_negative_ints,
    positive_float,
    positive_int,
    skip_fractions,
)
from viasd_hf.dimr import OBJECTIVES, search
from viasd_hf.extras import require
from viasd_hf.masks.repo import pair_folder, pair_id, user_masks_dir

CORPORA = ("spec-bench", "stratified")

# The options ``search_command_line`` spells out, in order, so that a saved mask says how to redo it.
_FLAGS = ("target", "drafter", "skip_ratio", "objective", "iterations", "bo_every", "patience", "time_budget", "seed",
          "finalists", "corpus", "prompts", "num_prompts", "num_heldout", "window", "depths", "max_prompt_tokens", "dtype", "out")  # fmt: skip


def _skip_ratios(text: str) -> float | list[float]:
    """One ratio searches one budget; a comma list (even of one) sweeps budgets."""
    values = skip_fractions(text)  # argparse reports a bad value as one line
    return values[0] if len(values) == 1 and "," not in text else values


# `--drafter` values that name no drafter model: the slim verifier's mask for drafts from no model, and the
# self-drafter's own drafting mask
MODEL_FREE_DRAFTERS = ("self", "self-drafter")


def add_search_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``viasd search``: find a routing mask with DIMR and save it with its search log."""
    parser = subparsers.add_parser(
        "search",
        help="find the slim verifier's routing mask for a target (and drafter) with DIMR",
        description="Search which decoder layers the slim verifier skips (DIMR), then save routing_mask.json "
        "and search_log.jsonl to --out.",
    )
    parser.add_argument("--target", required=True, help="zoo name, Hub id or local folder")
    parser.add_argument("--drafter",
                        help="drafter sharing the target's tokenizer (enables the Δ criterion); default: self (the slim "
                        "verifier's mask for prompt lookup and the self-drafter); self-drafter: the self-drafter's own "
                        "drafting mask")  # fmt: skip
    parser.add_argument("--skip-ratio", type=_skip_ratios, default=0.45,
                        help="fraction of layers to skip; a comma list (e.g. 0.1,0.15,0.2) sweeps budgets and keeps "
                        "the best predicted speed-up")  # fmt: skip
    parser.add_argument("--objective", choices=OBJECTIVES, default="via", help="via (KL-margin cost), kl, or top1")
    parser.add_argument("--iterations", type=positive_int, default=100, help="max masks evaluated per budget")
    parser.add_argument("--bo-every", type=positive_int, default=2,
                        help="propose by Bayesian optimisation when iteration %% N == 0")  # fmt: skip
    parser.add_argument("--patience", type=positive_int, default=30,
                        help="stop a budget after N evaluations without improvement")  # fmt: skip
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive_float, help="minutes for the whole search (all budgets)")
    budget.add_argument("--time-budget", type=positive_float, help="seconds for the whole search (all budgets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--finalists", type=positive_int, default=8,
                        help="the best N masks by calibration objective go on to the validation prompts, where the "
                        "winner is chosen (and, with --corpus stratified, one per task family: family_masks.json)")  # fmt: skip
    parser.add_argument("--corpus", choices=CORPORA, default="spec-bench",
                        help="spec-bench: Spec-Bench questions (or --prompts); stratified: six task families from the "
                        "shipped evaluation data (viasd_hf/calibration/corpus.py), whose held-out split the search never sees")  # fmt: skip
    parser.add_argument("--prompts", help="JSONL with a 'prompt' field, or text with one prompt per line (default: Spec-Bench)")
    parser.add_argument("--num-prompts", type=positive_int,
                        help=f"calibration prompts (default 32; per family with --corpus stratified: "
                        f"{DEFAULT_SIZES['calibration']})")  # fmt: skip
    parser.add_argument("--num-heldout", type=non_negative_int,
                        help=f"held-out prompts (disjoint) for agreement (default 16; with --corpus stratified, "
                        f"validation prompts per family: {DEFAULT_SIZES['validation']})")  # fmt: skip
    parser.add_argument("--window", type=positive_int, default=16, help="greedy continuation tokens scored per prompt (τ)")
    parser.add_argument("--depths", type=non_negative_ints,
                        help="window starts, in tokens into the target's continuation (default 0; with --corpus "
                        f"stratified: {','.join(map(str, DEFAULT_DEPTHS))})")  # fmt: skip
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="the deployment dtype (costs are measured in it)")  # fmt: skip
    parser.add_argument("--out", help=f"output folder (default: the pair's folder in {user_masks_dir()}, where generate "
                        "looks first)")
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


def _resolve_corpus_defaults(args: argparse.Namespace) -> None:
    """Sizes and depths left unset take the chosen corpus's defaults (per family for the stratified one)."""
    stratified = args.corpus == "stratified"
    if args.num_prompts is None:
        args.num_prompts = DEFAULT_SIZES["calibration"] if stratified else 32
    if args.num_heldout is None:
        args.num_heldout = DEFAULT_SIZES["validation"] if stratified else 16
    if args.depths is None:
        args.depths = list(DEFAULT_DEPTHS) if stratified else [0]


def _check_search_args(args: argparse.Namespace) -> None:
    """What can be checked before the models load (minutes): models, the output folder, the prompts and their number."""
    check_model(args.target, "--target")
    if args.drafter not in (None, *MODEL_FREE_DRAFTERS):
        check_model(args.drafter, "--drafter")
    check_output_dir(args.out, "--out")
    if args.corpus == "stratified":
        if args.prompts:
            raise UsageError("--prompts and --corpus stratified: choose one source of prompts")
        try:
            stratified_corpus(args.num_heldout, args.num_prompts, DEFAULT_SEED)
        except ValueError as error:
            raise UsageError(f"--corpus stratified: {first_line(error)}") from None
        return
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
    drafted = args.drafter not in (None, *MODEL_FREE_DRAFTERS)  # `--drafter self` is the default
    if args.minutes is not None:
        args.time_budget = 60 * args.minutes
    args.out = args.out or str(user_masks_dir() / pair_folder(pair_id(args.target), pair_id(args.drafter or "self")))
    _resolve_corpus_defaults(args)
    _check_search_args(args)
    require("skopt", "search", "viasd search")  # missing, said before a model loads
    target, tokenizer = load_model(args.target, args.dtype, "--target")
    drafter = load_model(args.drafter, args.dtype, "--drafter")[0] if drafted else None
    if args.corpus == "stratified":  # the corpus seed is fixed, so its held-out split stays the one masks are judged on
        corpus = stratified_corpus(args.num_heldout, args.num_prompts, DEFAULT_SEED)
        calibration = corpus_calibration(target, tokenizer, corpus, args.window, args.depths, args.max_prompt_tokens)
    else:
        calibration = build_calibration(
            target, tokenizer, prompts=args.prompts, num_prompts=args.num_prompts, num_heldout=args.num_heldout,
            window=args.window, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, depths=args.depths,
        )  # fmt: skip
    mask = search(
        target, drafter, calibration, skip_ratio=args.skip_ratio, objective=args.objective, iterations=args.iterations,
        bo_every=args.bo_every, patience=args.patience, time_budget=args.time_budget, seed=args.seed,
        finalists=args.finalists, out_dir=args.out, search_command=search_command_line(args),
    )  # fmt: skip
    heldout = mask.metadata.get("heldout") or {}
    print(
        f"skip {mask.skipped_layers} of {mask.num_layers} layers; {mask.objective} = {mask.objective_value:.4f}; "
        f"validation top-1 {heldout.get('top1', float('nan')):.3f}, KL {heldout.get('kl', float('nan')):.3f}; "
        f"{mask.metadata['masks_evaluated']} masks in {mask.search_time_s:.0f}s -> {args.out}"
    )
    return 0
