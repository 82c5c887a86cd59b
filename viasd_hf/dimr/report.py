"""A searched mask next to the baselines at the same budget: random masks and early exit, as numbers and a table."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import nn

from ..calibration import TeacherForcedReference, Window
from ..masks import RoutingMask
from .objectives import as_reference, score_mask
from .space import early_exit_mask, random_masks


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
