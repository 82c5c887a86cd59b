"""DIMR's agreement-vs-budget curve: how much of the full model a routing mask keeps as it skips more layers.

Two steps around ``python -m viasd_hf.dimr.heldout`` (which scores masks on held-out prompts against random
masks and early exit of the same budget):

    python bench/studies/dimr_curve/study.py masks SEARCH_DIR [SEARCH_DIR ...] --out DIR [--budgets 4,7,10,13]
        one subfolder per budget (``skip<k>``) with the best mask any of the searches found at it: the mask a
        search saved, or the winner it recorded per budget of a sweep (its ``metadata["sweep"]``);
    python -m viasd_hf.dimr.heldout --target TARGET --masks DIR ...
        writes DIR/heldout_comparison.json (and .md);
    python bench/studies/dimr_curve/study.py curve DIR/heldout_comparison.json
        the curve as one Markdown table: per budget, the searched mask, the median random mask and early exit
        (KL(q||q') and top-1 agreement with the full model, all held-out families pooled).

See README.md beside this file for the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from viasd_hf.masks.routing_mask import RoutingMask


def budget_winners(search: Path) -> dict[int, RoutingMask]:
    """Skipped-layer count -> the mask a search chose at that budget (each budget of a sweep, or its one mask)."""
    mask = RoutingMask.from_pretrained(search)
    winners = {len(mask.skipped_layers): mask}
    for entry in mask.metadata.get("sweep") or []:
        skipped = entry["skipped"]
        kept = [layer for layer in range(mask.num_layers) if layer not in skipped]
        metadata = {**mask.metadata, "chosen_from_sweep": {"heldout": entry.get("heldout"),
                                                            "calibration": entry.get("calibration")}}
        metadata.pop("sweep")
        winners.setdefault(len(skipped), dataclasses.replace(
            mask, kept_layers=kept, skip_ratio=round(len(skipped) / mask.num_layers, 4),
            objective_value=entry.get("objective_value"), metadata=metadata))
    return winners


def write_masks(searches: list[Path], budgets: list[int] | None, out: Path) -> None:
    found: dict[int, tuple[Path, RoutingMask]] = {}
    for search in searches:
        for k, mask in budget_winners(search).items():
            found.setdefault(k, (search, mask))
    for k in sorted(found):
        if budgets and k not in budgets:
            continue
        search, mask = found[k]
        mask.save_pretrained(out / f"skip{k}")
        print(f"skip{k}: layers {mask.skipped_layers} (from {search})")
    missing = sorted(set(budgets or []) - set(found))
    if missing:
        raise SystemExit(f"no search found a mask skipping {missing} layers")


def curve(comparison: dict) -> str:
    rows = ["| skipped | searched layers | KL, searched | KL, random median | KL, early exit | top-1, searched "
            "| top-1, random median (range) | top-1, early exit |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for entry in sorted(comparison["masks"], key=lambda m: m["k"]):
        pooled = entry["families"]["all"]
        mask, random, early = pooled["mask"], pooled["random"], pooled["early_exit"]
        top1 = random["top1"]
        rows.append(f"| {entry['k']}/{entry['num_layers']} ({entry['k'] / entry['num_layers']:.0%}) | "
                    f"{entry['skipped']} | {mask['kl']:.3f} | {random['kl']['median']:.3f} | {early['kl']:.3f} | "
                    f"{mask['top1']:.3f} | {top1['median']:.3f} ({top1['min']:.3f}–{top1['max']:.3f}) | "
                    f"{early['top1']:.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    masks = steps.add_parser("masks", help="one folder per budget with the best searched mask")
    masks.add_argument("searches", nargs="+", type=Path, help="folders `viasd search` wrote")
    masks.add_argument("--out", type=Path, required=True)
    masks.add_argument("--budgets", type=lambda text: [int(k) for k in text.split(",")],
                       help="skipped-layer counts to keep (default: every budget found)")
    table = steps.add_parser("curve", help="the curve from a heldout_comparison.json")
    table.add_argument("comparison", type=Path)
    args = parser.parse_args()
    if args.step == "masks":
        write_masks(args.searches, args.budgets, args.out)
    else:
        print(curve(json.loads(args.comparison.read_text())))


if __name__ == "__main__":
    main()
