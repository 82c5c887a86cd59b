"""A mask next to the baselines at the same budget, random masks and early exit, as numbers and tables.

``compare_with_baselines`` scores one mask on one set of windows; ``versus_baselines`` and the
tables below present the per-family held-out comparison of ``dimr.heldout``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import nn

from viasd_hf.calibration.windows import TeacherForcedReference, Window
from viasd_hf.dimr.objectives import MaskScore, as_reference, score_mask
from viasd_hf.dimr.space import early_exit_mask, random_masks
from viasd_hf.masks.routing_mask import RoutingMask


def compare_with_baselines(
    target: nn.Module,
    mask: RoutingMask,
    windows: TeacherForcedReference | Sequence[Window],
    n_random: int = 5,
    seed: int = 0,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
) -> dict[str, Any]:
    """The searched mask vs the median of ``n_random`` random masks and early exit, same budget."""
    reference = as_reference(target, windows)
    k = len(mask.skipped_layers)
    random_scores = [score_mask(reference, m, alpha1, alpha2) for m in random_masks(target, k, n_random, seed)]
    early = early_exit_mask(target, k)
    return {
        "k": k,
        "num_layers": mask.num_layers,
        "positions": reference.positions,
        "searched": {"skipped": mask.skipped_layers, **asdict(score_mask(reference, mask, alpha1, alpha2))},
        "random_median": {
            "n": len(random_scores),
            **{name: statistics.median(getattr(s, name) for s in random_scores) for name in ("kl", "top1", "via")},
            "top1_range": [min(s.top1 for s in random_scores), max(s.top1 for s in random_scores)],
        },
        "early_exit": {"skipped": early.skipped_layers, **asdict(score_mask(reference, early, alpha1, alpha2))},
    }


def baseline_table(comparison: Mapping[str, Any]) -> str:
    """A Markdown table of a ``compare_with_baselines`` result."""
    k, layers = comparison["k"], comparison["num_layers"]
    searched, rand, early = comparison["searched"], comparison["random_median"], comparison["early_exit"]
    low, high = rand["top1_range"]
    lines = [
        f"Skip {k}/{layers} layers ({k / layers:.0%}); held-out, {comparison['positions']} positions",
        "",
        "| mask | skipped layers | KL(q‖q′) | top-1 agreement | VIA cost |",
        "|---|---|---|---|---|",
        f"| DIMR searched | {searched['skipped']} | {searched['kl']:.3f} | {searched['top1']:.3f} | {searched['via']:.3f} |",
        f"| random, median of {rand['n']} | — | {rand['kl']:.3f} | {rand['top1']:.3f} (range {low:.3f}–{high:.3f}) | {rand['via']:.3f} |",
        f"| early exit | {early['skipped']} | {early['kl']:.3f} | {early['top1']:.3f} | {early['via']:.3f} |",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- per task family, held out

METRICS = {"kl": "KL(q‖q′)", "top1": "top-1 agreement", "via": "VIA cost"}
_LOWER_IS_BETTER = {"kl": True, "top1": False, "via": True}


def _better(a: float, b: float, metric: str) -> bool:
    return a < b if _LOWER_IS_BETTER[metric] else a > b


def versus_baselines(mask: MaskScore, randoms: Sequence[MaskScore], early: MaskScore) -> dict[str, Any]:
    """A mask's score beside the random masks' median and range and early exit, and how many random masks it beats."""
    random = {}
    for metric in METRICS:
        values = [getattr(r, metric) for r in randoms]
        random[metric] = {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}
    return {
        "positions": mask.positions,
        "mask": asdict(mask),
        "random": random,
        "early_exit": asdict(early),
        "beats_random_median": {m: _better(getattr(mask, m), random[m]["median"], m) for m in METRICS},
        "random_beaten": {m: sum(_better(getattr(mask, m), v, m) for v in random[m]["values"]) for m in METRICS},
    }


def family_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per family (and ``all``): each metric for the mask, the random median (range) and early exit."""
    header = ["family", "positions"]
    for name in METRICS.values():
        header += [f"{name}: mask", "random median (min–max)", "early exit"]
    header.append("random masks beaten (KL / top-1 / VIA)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family, row in rows.items():
        cells = [f"**{family}**" if family == "all" else family, str(row["positions"])]
        for metric in METRICS:
            mark = "" if row["beats_random_median"][metric] else " ✗"
            spread = row["random"][metric]
            cells += [f"{row['mask'][metric]:.3f}{mark}", f"{spread['median']:.3f} ({spread['min']:.3f}–{spread['max']:.3f})",
                      f"{row['early_exit'][metric]:.3f}"]  # fmt: skip
        beaten = row["random_beaten"]
        cells.append(" / ".join(f"{beaten[m]}/{len(row['random'][m]['values'])}" for m in METRICS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(entry: Mapping[str, Any]) -> str:
    """One sentence per mask: the families where it beats the random median on held-out KL, and where it does not.

    A family mask (``meant_for`` a family) is judged on that family only.
    """
    if entry.get("meant_for"):
        family = entry["meant_for"]
        row = entry["families"][family]
        beats = "beats" if row["beats_random_median"]["kl"] else "**does not beat**"
        return (f"`{entry['folder']}` (skips {entry['skipped']}), meant for {family}: {beats} the random median on "
                f"{family}'s held-out KL ({row['mask']['kl']:.3f} vs {row['random']['kl']['median']:.3f}).")  # fmt: skip
    families = {f: row for f, row in entry["families"].items() if f != "all"}
    losing = [f for f, row in families.items() if not row["beats_random_median"]["kl"]]
    head = f"`{entry['folder']}` (skips {entry['skipped']}): beats the random median on held-out KL in " \
           f"{len(families) - len(losing)} of {len(families)} families"  # fmt: skip
    if not losing:
        return head + "."
    details = ", ".join(
        f"{f} ({families[f]['mask']['kl']:.3f} vs {families[f]['random']['kl']['median']:.3f})" for f in losing
    )
    return f"{head}; **not in {details}**."


def family_masks_section(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each family mask (``family_masks.json``) beside its folder's general mask, on that family's held-out windows."""
    general = {e["folder"]: e for e in entries if not e.get("meant_for")}
    rows = []
    for entry in (e for e in entries if e.get("meant_for")):
        family = entry["meant_for"]
        parent = general[entry["folder"].rsplit("/", 1)[0]]
        own, base = entry["families"][family], parent["families"][family]
        better = "same mask" if entry["skipped"] == parent["skipped"] else "yes" if own["mask"]["kl"] < base["mask"]["kl"] else "no"
        rows.append(f"| `{entry['folder']}` | {entry['skipped']} | {own['mask']['kl']:.3f} | {base['mask']['kl']:.3f} | "
                    f"{own['random']['kl']['median']:.3f} | {own['mask']['via']:.3f} | {base['mask']['via']:.3f} | {better} |")  # fmt: skip
    if not rows:
        return []
    return [
        "",
        "## Family masks against the general mask",
        "",
        "Per task family, the finalist of the search that won on that family's validation windows "
        "(`family_masks.json`), on that family's held-out windows only.",
        "",
        "| family mask | skipped | KL: family mask | KL: general mask | KL: random median | VIA: family mask | "
        "VIA: general mask | lower KL than general? |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def heldout_markdown(result: Mapping[str, Any]) -> str:
    """``heldout_comparison.md`` from a ``dimr.heldout.heldout_comparison`` result (with ``target`` and ``command``)."""
    settings, heldout = result["settings"], result["heldout"]
    depths = ", ".join(map(str, settings["depths"]))
    lines = [
        f"# Held-out comparison by task family: {result['target']} ({settings['dtype']})",
        "",
        f"Reproduce: `{result['command']}`",
        "",
    ]
    if result.get("weights"):
        lines += [f"Weights: the built-in `{result['target']}` ({result['weights']}), dequantised on conversion "
                  "(`viasd_hf/models/zoo.py`); the figures and the masks apply to those weights.", ""]  # fmt: skip
    lines += [
        f"Held-out prompts: the {settings['corpus']} (`viasd_hf/calibration/corpus.py`): per family its first "
        f"{settings['heldout_per_family']} held-out prompts, less every prompt whose content matches one that a "
        "mask's search calibrated or selected on (the ids in the masks' metadata). Windows: τ = "
        f"{settings['window']} tokens starting {depths} tokens into the target's own greedy continuation, scored "
        f"from the full model's prefix cache; prompts cut at {settings['max_prompt_tokens']} tokens. Baselines at "
        f"each mask's budget: the median and range of {settings['random_masks']} distinct random masks (seed "
        f"{settings['random_seed']}; protected layers never skipped), and early exit. KL and VIA cost (α = "
        f"{settings['alpha1']}, {settings['alpha2']}): lower is better; top-1: higher. ✗ marks a mask value "
        "that does not beat the random median; `all` pools the families by positions.",
        "",
        "## Verdict",
        "",
        *(f"- {verdict(entry)}" for entry in result["masks"]),
        "",
        "## Held-out windows",
        "",
        "| family | prompts | windows | positions | dropped: used by a shipped mask's search |",
        "|---|---|---|---|---|",
        *(f"| {family} | {len(h['prompts'])} | {h['windows']} | {h['positions']} | "
          f"{', '.join(h['dropped_as_used_in_search']) or '—'} |" for family, h in heldout.items()),  # fmt: skip
    ]
    lines += family_masks_section(result["masks"])
    for entry in (e for e in result["masks"] if not e.get("meant_for")):
        k, layers = entry["k"], entry["num_layers"]
        lines += [
            "",
            f"## `{entry['folder']}` (drafter: {entry['drafter']}; skips {entry['skipped']}, {k}/{layers} layers)",
            "",
            f"Random masks: {', '.join(map(str, entry['families']['all']['random_skipped']))}; early exit: "
            f"{entry['families']['all']['early_exit_skipped']}.",
            "",
            family_table(entry["families"]),
        ]
    return "\n".join(lines) + "\n"
