"""Shipped masks on held-out prompts, per task family, against random masks and early exit at the same budget.

A mask is only judged on prompts that no step of its search saw: the stratified corpus's held-out
split (``viasd_hf.calibration.corpus``), less any prompt whose content matches one the mask's search
calibrated or selected on (the ids it records). Each family is scored on its own, because a mask
that wins on average can still lose on the family it is deployed for. Every mask of a
target is scored on the same windows, against the same random masks, so the rows compare like
with like.

``python -m viasd_hf.dimr.heldout --target smollm2-135m-instruct`` writes
``hub_masks/<target>/heldout_comparison.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from viasd_hf.calibration.corpus import (
    DEFAULT_DEPTHS,
    DEFAULT_SEED,
    HELDOUT_PER_FAMILY,
    Corpus,
    content_keys,
    stratified_corpus,
)
from viasd_hf.calibration.windows import Prompt, TeacherForcedReference, Window, build_windows
from viasd_hf.dimr.family_masks import FAMILY_MASKS_FILENAME, load_family_masks
from viasd_hf.dimr.objectives import MaskScore, pooled, score_mask
from viasd_hf.dimr.report import heldout_markdown, versus_baselines
from viasd_hf.dimr.search_log import to_json_safe
from viasd_hf.dimr.space import early_exit_mask, random_masks
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.loading import load_pretrained
from viasd_hf.models.zoo import ZOO

MASK_FILE = "routing_mask.json"
Scores = dict[str, dict[tuple[int, ...], MaskScore]]  # family -> skipped layers -> score


def shipped_masks(folder: Path) -> dict[str, RoutingMask]:
    """The masks in ``folder``'s subfolders (``model-free``, ``self-draft``, a drafter slug), by subfolder name.

    A subfolder with ``family_masks.json`` also gives one mask per task family, as ``<subfolder>/<family>``.
    """
    masks = {}
    for path in sorted(folder.glob(f"*/{MASK_FILE}")):
        masks[path.parent.name] = RoutingMask.from_pretrained(path.parent)
        if (path.parent / FAMILY_MASKS_FILENAME).is_file():
            masks |= {f"{path.parent.name}/{f}": m for f, m in load_family_masks(path.parent).items()}
    return masks


def used_prompt_ids(mask: RoutingMask) -> list[str]:
    """Every prompt a mask's search saw: its calibration prompts and the held-out (validation) prompts it chose on."""
    metadata = mask.metadata or {}
    return [*metadata.get("calibration_prompt_ids", []), *metadata.get("heldout_prompt_ids", [])]


def heldout_prompts(
    corpus: Corpus, used_ids: Sequence[str], limit: int | None = None
) -> tuple[dict[str, list[Prompt]], dict[str, list[str]]]:
    """Per family, the held-out prompts no search used (up to ``limit``), and the ids dropped for overlap."""
    used = set(content_keys(used_ids).values())
    kept: dict[str, list[Prompt]] = {}
    dropped: dict[str, list[str]] = {}
    for family in corpus.families:
        prompts = corpus.splits["heldout"][family]
        keys = content_keys(p.id for p in prompts)
        kept[family] = [p for p in prompts if keys[p.id] not in used][:limit]
        dropped[family] = [p.id for p in prompts if keys[p.id] in used]
    return kept, dropped


def score_families(
    target: nn.Module,
    windows: Mapping[str, Sequence[Window]],
    masks: Sequence[RoutingMask],
    alphas: Mapping[str, float],
    progress: bool = True,
) -> Scores:
    """Each distinct mask's score on each family's windows; one full-model reference per family, freed after it."""
    distinct = {tuple(m.skipped_layers): m for m in masks}
    scores: Scores = {}
    for family, family_windows in tqdm(windows.items(), desc="held-out families", unit="family", disable=not progress):
        reference = TeacherForcedReference(target, family_windows, progress=False)
        scores[family] = {skip: score_mask(reference, mask, **alphas) for skip, mask in distinct.items()}
        del reference
    return scores


def heldout_comparison(
    target: nn.Module,
    tokenizer: Any,
    masks: Mapping[str, RoutingMask],
    corpus: Corpus,
    n_random: int = 9,
    seed: int = 0,
    limit: int | None = None,
    window: int = 16,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    max_prompt_tokens: int = 384,
    progress: bool = True,
) -> dict[str, Any]:
    """Per mask and family: KL / top-1 / VIA cost of the mask, ``n_random`` random masks and early exit."""
    alphas = {(m.alpha1, m.alpha2) for m in masks.values()}
    if len(alphas) != 1:
        raise ValueError(f"the masks were searched with different VIA margins {sorted(alphas)}; compare them one at a time")
    alpha1, alpha2 = alphas.pop()
    used = [i for mask in masks.values() for i in used_prompt_ids(mask)]
    prompts, dropped = heldout_prompts(corpus, used, limit)
    build = dict(window=window, max_prompt_tokens=max_prompt_tokens, progress=progress, depths=depths)
    windows = {family: build_windows(target, tokenizer, chosen, **build) for family, chosen in prompts.items()}
    budgets = sorted({len(m.skipped_layers) for m in masks.values()})
    baselines = {k: (random_masks(target, k, n_random, seed), early_exit_mask(target, k)) for k in budgets}
    everything = [*masks.values(), *(m for randoms, early in baselines.values() for m in [*randoms, early])]
    scores = score_families(target, windows, everything, {"alpha1": alpha1, "alpha2": alpha2}, progress)
    return {
        "heldout": {
            family: {"prompts": [p.id for p in prompts[family]], "dropped_as_used_in_search": dropped[family],
                     "windows": len(windows[family]), "positions": sum(w.positions for w in windows[family])}
            for family in prompts
        },  # fmt: skip
        "settings": {"corpus": corpus.describe(), "corpus_seed": corpus.seed, "heldout_per_family": limit or HELDOUT_PER_FAMILY,
                     "window": window, "depths": list(depths), "max_prompt_tokens": max_prompt_tokens,
                     "random_masks": n_random, "random_seed": seed, "alpha1": alpha1, "alpha2": alpha2,
                     "dtype": str(next(target.parameters()).dtype).removeprefix("torch.")},  # fmt: skip
        "masks": [
            {"folder": folder, "drafter": mask.drafter_id, "skipped": mask.skipped_layers, "k": len(mask.skipped_layers),
             "num_layers": mask.num_layers, "meant_for": (mask.metadata or {}).get("family"),
             "families": family_rows(scores, mask, *baselines[len(mask.skipped_layers)])}  # fmt: skip
            for folder, mask in masks.items()
        ],
    }


def family_rows(scores: Scores, mask: RoutingMask, randoms: Sequence[RoutingMask], early: RoutingMask) -> dict[str, Any]:
    """``versus_baselines`` for every family, and for all families pooled (``"all"``)."""
    families = list(scores)

    def of(m: RoutingMask, among: Sequence[str]) -> MaskScore:
        return pooled([scores[family][tuple(m.skipped_layers)] for family in among])

    rows = {}
    for label, among in [*((family, [family]) for family in families), ("all", families)]:
        rows[label] = versus_baselines(of(mask, among), [of(r, among) for r in randoms], of(early, among))
        rows[label]["random_skipped"] = [r.skipped_layers for r in randoms]
        rows[label]["early_exit_skipped"] = early.skipped_layers
    return rows


# --------------------------------------------------------------------------- python -m viasd_hf.dimr.heldout


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m viasd_hf.dimr.heldout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="zoo name, Hub id or local folder")
    parser.add_argument("--masks", help="folder with one subfolder per mask (default: hub_masks/<target>)")
    parser.add_argument("--dtype", default="float32", help="dtype the target is scored in")
    parser.add_argument("--random", type=int, default=9, help="random masks per budget (the baseline's spread)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random masks")
    parser.add_argument("--corpus-seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--limit", type=int, help=f"held-out prompts per family (default: all {HELDOUT_PER_FAMILY} not used)")
    parser.add_argument("--window", type=int, default=16, help="scored tokens per window (τ)")
    parser.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)), help="window starts into the continuation")
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's, %(default)s here); one where another job shares the cores")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Score a target's shipped masks per family and write ``heldout_comparison.md`` and ``.json`` next to them."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(args.masks or Path("hub_masks") / Path(args.target.rstrip("/")).name.lower())
    masks = shipped_masks(folder)
    if not masks:
        raise SystemExit(f"no */{MASK_FILE} under {folder}")
    target, tokenizer = load_pretrained(args.target, dtype=args.dtype)
    for mask in masks.values():
        mask.validate_for(target)
    depths = [int(d) for d in args.depths.split(",")]
    result = heldout_comparison(target, tokenizer, masks, stratified_corpus(seed=args.corpus_seed), n_random=args.random,
                                seed=args.seed, limit=args.limit, window=args.window, depths=depths,
                                max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
    command = shlex.join(["python", "-m", "viasd_hf.dimr.heldout", *(argv if argv is not None else sys.argv[1:])])
    weights = ZOO[args.target].architecture if args.target in ZOO else None
    result = to_json_safe({"target": args.target, "weights": weights, "command": command, **result})
    (folder / "heldout_comparison.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "heldout_comparison.md").write_text(heldout_markdown(result))
    print(f"wrote {folder / 'heldout_comparison.md'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
