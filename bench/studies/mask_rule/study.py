"""A routing mask by rule, for a model with no searched mask: which rule, and does it beat a random mask?

For each target: the stratified corpus's held-out split (as ``viasd_hf.dimr.heldout``), every candidate rule's
mask at each skip ratio, and at the ``--verdict-ratios`` the random masks and early exit of the same budget; each
candidate is compared with them per task family and pooled (``report.versus_baselines``), as in
``hub_masks/*/heldout_comparison.md``. At the other ``--ratios`` only the candidates are scored.

    python bench/studies/mask_rule/study.py --targets smollm2-135m-instruct,gemma3-270m --limit 4 --depths 0,32
    python bench/studies/mask_rule/study.py --targets qwen2.5-coder-0.5b-instruct --candidates middle-out-spared \
        --verdict-ratios 0.15,0.25 --limit 2 --depths 0,32

write ``results/<target>.md`` (per-family tables) and ``.json`` (every mask's score per family; a rerun with the
same settings scores only masks not in it) beside this file, and print the summary tables. See README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from viasd_hf.calibration.corpus import DEFAULT_SEED, stratified_corpus
from viasd_hf.calibration.windows import build_windows
from viasd_hf.dimr.heldout import family_rows, heldout_prompts, score_families
from viasd_hf.dimr.objectives import MaskScore, pooled
from viasd_hf.dimr.report import METRICS, family_table
from viasd_hf.dimr.search_log import to_json_safe
from viasd_hf.dimr.space import early_exit_mask, random_masks, skip_count
from viasd_hf.masks.architectures import decoder_layers, num_decoder_layers, protected_layers
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.masks.rules import middle_out_order, rare_kind_layers, rule_layers
from viasd_hf.models.loading import load_pretrained

HERE = Path(__file__).parent
Rule = Callable[[int, set[int], int, set[int]], list[int]]  # (layers, protected, k, rarer-kind layers) -> skipped


def _evenly(layers: Sequence[int], k: int) -> list[int]:
    """``k`` of ``layers``, evenly spaced, each at the centre of its share (so the ends are not favoured)."""
    return sorted({layers[math.floor((i + 0.5) * len(layers) / k)] for i in range(k)})


def spread(num_layers: int, protected: set[int], k: int, rare: set[int]) -> list[int]:
    """Evenly spaced over every skippable layer."""
    return _evenly([layer for layer in range(num_layers) if layer not in protected], k)


def middle_half(num_layers: int, protected: set[int], k: int, rare: set[int]) -> list[int]:
    """Evenly spaced over the middle half of the stack ([L/4, 3L/4)), widened one layer a side until k fit."""
    skippable = [layer for layer in range(num_layers) if layer not in protected]
    low, high = math.floor(num_layers / 4 + 0.5), math.floor(3 * num_layers / 4 + 0.5)
    region = [layer for layer in skippable if low <= layer < high]
    while len(region) < k:
        low, high = low - 1, high + 1
        region = [layer for layer in skippable if low <= layer < high]
    return _evenly(region, k)


def middle_out(num_layers: int, protected: set[int], k: int, rare: set[int]) -> list[int]:
    """Every other layer from the middle outward (L//2, L//2 - 2, L//2 + 2, ...), then the ones between, likewise."""
    return sorted(middle_out_order(num_layers, protected)[:k])


# The three rules tried first (they ignore attention kinds), and the one designed after their run (random masks
# skipping layer 1, or Gemma 3's full-attention layer 11, were among the worst): middle-out sparing layers 1 and
# L - 2 and the rarer attention kinds, kept as ``viasd_hf.masks.rules.rule_layers``.
CANDIDATES: dict[str, Rule] = {"spread": spread, "middle-half": middle_half, "middle-out": middle_out,
                               "middle-out-spared": rule_layers}


def predicted_speedup(top1: float, draft_cost: float, max_block: int = 8) -> tuple[float, int]:
    """Greedy self-drafting at per-token acceptance a = ``top1``: γ drafts a block at ``draft_cost`` c of a full
    pass each, one full pass to verify: (1 + a + … + a^γ) / (γ·c + 1) tokens per full pass, at the best γ (and γ)."""
    return max((sum(top1**i for i in range(g + 1)) / (g * draft_cost + 1), g) for g in range(1, max_block + 1))


def draft_cost(model: torch.nn.Module, skipped: Sequence[int]) -> float:
    """A routed pass's share of a full one by weights read: the kept layers plus the LM head (embeddings excluded)."""
    layers = decoder_layers(model)
    size = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    head = model.get_output_embeddings().weight.numel()
    return (head + sum(s for i, s in enumerate(size) if i not in set(skipped))) / (head + sum(size))


def study(target_name: str, args: argparse.Namespace) -> dict:
    started = time.time()
    target, tokenizer = load_pretrained(target_name, dtype=args.dtype)
    layers, protected, rare = num_decoder_layers(target), set(protected_layers(target)), rare_kind_layers(target)
    ratios = sorted(set(args.ratios) | set(args.verdict_ratios))
    masks: dict[tuple[str, float], RoutingMask] = {}
    for ratio in ratios:
        k = skip_count(target, ratio)
        for name in args.candidates:
            skip = CANDIDATES[name](layers, protected, k, rare)
            assert len(skip) == k and not protected & set(skip), (name, ratio, skip)
            masks[name, ratio] = RoutingMask.from_model(target, skip=skip, skip_ratio=ratio, metadata={"rule": name})
    budgets = {ratio: skip_count(target, ratio) for ratio in args.verdict_ratios}
    baselines = {ratio: (random_masks(target, k, args.random, args.seed), early_exit_mask(target, k))
                 for ratio, k in budgets.items()}
    prompts, _ = heldout_prompts(stratified_corpus(seed=args.corpus_seed), [], args.limit)
    build = dict(window=args.window, max_prompt_tokens=args.max_prompt_tokens, depths=args.depths, progress=False)
    windows = {family: build_windows(target, tokenizer, chosen, **build) for family, chosen in prompts.items()}
    continued = time.time()
    everything = [*masks.values(), *(m for randoms, early in baselines.values() for m in [*randoms, early])]
    settings = {key: getattr(args, key) for key in SETTINGS}
    cached = cached_scores(args.out / f"{target_name}.json", settings)
    new = [m for m in everything if any(tuple(m.skipped_layers) not in cached.get(f, {}) for f in windows)]
    scores = score_families(target, windows, new, {"alpha1": 0.5, "alpha2": 0.3}, progress=False) if new else {}
    scores = {family: cached.get(family, {}) | scores.get(family, {}) for family in windows}
    result = {
        "target": target_name, "layers": layers, "protected": sorted(protected), "dtype": args.dtype,
        "heldout": {f: {"prompts": [p.id for p in prompts[f]], "windows": len(windows[f]),
                        "positions": sum(w.positions for w in windows[f])} for f in prompts},
        "settings": settings,
        "seconds": {"load_and_continuations": round(continued - started), "scoring": round(time.time() - continued),
                    "masks_scored": len({tuple(m.skipped_layers) for m in new})},
        "scores": {f: {",".join(map(str, skip)): asdict(score) for skip, score in by_skip.items()}
                   for f, by_skip in scores.items()},
        "rules": [],
    }  # fmt: skip
    for (name, ratio), mask in masks.items():
        all_families = pooled([scores[f][tuple(mask.skipped_layers)] for f in scores])
        entry = {"rule": name, "ratio": ratio, "k": len(mask.skipped_layers), "skipped": mask.skipped_layers,
                 "pooled": asdict(all_families), "draft_cost": draft_cost(target, mask.skipped_layers)}  # fmt: skip
        entry["predicted_speedup"], entry["best_block"] = predicted_speedup(all_families.top1, entry["draft_cost"])
        if ratio in baselines:
            entry["families"] = family_rows(scores, mask, *baselines[ratio])
        result["rules"].append(entry)
    return to_json_safe(result)


SETTINGS = ("dtype", "random", "seed", "corpus_seed", "limit", "window", "depths", "max_prompt_tokens")


def cached_scores(path: Path, settings: dict) -> dict[str, dict[tuple[int, ...], MaskScore]]:
    """Per family, the scores an earlier run with the same settings wrote to ``path`` (masks are not scored twice)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    if old.get("settings") != settings:
        return {}
    return {f: {tuple(int(x) for x in skip.split(",") if x): MaskScore(**score) for skip, score in by_skip.items()}
            for f, by_skip in old.get("scores", {}).items()}  # fmt: skip


def summary(result: dict) -> list[str]:
    """Per target: each rule at each verdict ratio pooled against the baselines, and the families it wins."""
    lines = [f"### {result['target']} ({result['layers']} layers, protected {result['protected']}, {result['dtype']})",
             "", "| rule | skipped | KL: rule | random median (min–max) | early exit | top-1: rule | random median "
             "(min–max) | early exit | families beating the random median: KL / top-1 |", "|---" * 9 + "|"]
    for entry in (e for e in result["rules"] if "families" in e):
        row = entry["families"]["all"]
        wins = families_beating(entry["families"])
        n = len(entry["families"]) - 1
        cells = [entry["rule"], f"{entry['k']}/{result['layers']}: {entry['skipped']}"]
        for metric in ("kl", "top1"):
            spread = row["random"][metric]
            mark = "" if row["beats_random_median"][metric] else " ✗"
            span = f"{spread['median']:.3f} ({spread['min']:.3f}–{spread['max']:.3f})"
            cells += [f"{row['mask'][metric]:.3f}{mark}", span, f"{row['early_exit'][metric]:.3f}"]
        cells.append(f"{wins['kl']}/{n} / {wins['top1']}/{n}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| rule | ratio | skipped | pooled KL | pooled top-1 | draft cost | predicted self-draft speed-up "
              "(γ) |", "|---" * 7 + "|"]
    for entry in sorted(result["rules"], key=lambda e: (e["rule"], e["ratio"])):
        lines.append(f"| {entry['rule']} | {entry['ratio']} | {entry['k']}/{result['layers']}: {entry['skipped']} | "
                     f"{entry['pooled']['kl']:.3f} | {entry['pooled']['top1']:.3f} | {entry['draft_cost']:.2f} | "
                     f"{entry['predicted_speedup']:.2f} ({entry['best_block']}) |")  # fmt: skip
    return lines


def markdown(result: dict, command: str) -> str:
    lines = [f"# Masks by rule on held-out prompts: {result['target']}", "", f"Reproduce: `{command}`", "",
             "| family | prompts | windows | positions |", "|---|---|---|---|",
             *(f"| {f} | {len(h['prompts'])} | {h['windows']} | {h['positions']} |"
               for f, h in result["heldout"].items()),
             "", *summary(result)]  # fmt: skip
    for entry in (e for e in result["rules"] if "families" in e):
        row = entry["families"]["all"]
        lines += ["", f"## `{entry['rule']}` at {entry['ratio']} (skips {entry['skipped']})", "",
                  f"Random masks: {', '.join(map(str, row['random_skipped']))}; "
                  f"early exit: {row['early_exit_skipped']}.",
                  "", family_table(entry["families"])]  # fmt: skip
    return "\n".join(lines) + "\n"


def families_beating(families: dict) -> dict[str, int]:
    """Per metric, the task families (not ``all``) where the mask beats the random median."""
    return {m: sum(row["beats_random_median"][m] for f, row in families.items() if f != "all") for m in METRICS}


def compact(result: dict) -> dict:
    """``result`` for the JSON file: per rule, its pooled row against the baselines and the number of families it
    wins (the per-family rows are in the Markdown file, and follow from ``scores``)."""
    rules = []
    for entry in result["rules"]:
        families = entry.get("families")
        if families:
            wins = families_beating(families)
            entry = {**entry, "families": {"all": families["all"]}, "families_beating_random_median": wins}
        rules.append(entry)
    return {**result, "rules": rules}


def main(argv: Sequence[str] | None = None) -> int:
    floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="smollm2-135m-instruct,gemma3-270m", help="comma-separated zoo names")
    parser.add_argument("--verdict-ratios", type=floats, default=[0.15, 0.25, 0.45], help="compared with baselines")
    parser.add_argument("--ratios", type=floats, default=[], help="rules only (budget curve)")
    parser.add_argument("--candidates", type=lambda text: text.split(","), default=list(CANDIDATES),
                        help=f"rules to score (default: all of {', '.join(CANDIDATES)})")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--limit", type=int, default=4, help="held-out prompts per family")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--depths", type=lambda text: [int(x) for x in text.split(",")], default=[0, 32])
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "bench/studies/mask_rule/study.py", *(argv if argv is not None else sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.targets.split(","):
        result = study(name, args) | {"command": command}
        (args.out / f"{name}.md").write_text(markdown(result, command))
        (args.out / f"{name}.json").write_text(json.dumps(compact(result)) + "\n")
        print("\n".join(summary(result)) + f"\n\n({result['seconds']})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
