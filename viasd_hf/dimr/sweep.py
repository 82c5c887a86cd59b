"""Several skip budgets: search each in turn, then weigh each winner's agreement against its measured cost.

The winner of each budget is scored on held-out windows and, in a sweep, timed on this machine;
``predicted_speedup`` turns the two into the figure the sweep keeps the best of.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import nn

from viasd_hf.calibration.windows import TeacherForcedReference
from viasd_hf.dimr.budget import BudgetResult, search_budget
from viasd_hf.dimr.objectives import score_mask
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.profiling import forward_seconds

SPEEDUP_MODEL = (
    "predicted speed-up of the 3-tier block over the 2-tier baseline = 1 / (c + 1 - a^γ): every block pays "
    "one slim pass of cost c (measured slim/full time of a (γ+1)-token block over a cached context) and "
    "escalates to the full model unless the slim model's top-1 agrees with the full model's at all γ "
    "drafted positions (a = held-out top-1 agreement). Drafter cost and acceptance length are the same "
    "in both and left out; > 1 means the slim tier pays."
)


def predicted_speedup(slim_cost: float, agreement: float, gamma: int) -> float:
    """See ``SPEEDUP_MODEL``: full passes saved per block by the slim tier, net of its own cost."""
    return 1.0 / (slim_cost + 1.0 - agreement**gamma)


def measure_slim_costs(
    target: nn.Module, masks: Mapping[str, RoutingMask], context_tokens: int, block_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Slim/full time ratios for a 1-token and a ``block_tokens`` forward over a cached context."""
    seconds = forward_seconds(
        target, context_tokens=context_tokens, block_tokens=(1, block_tokens), masks={"full": None, **masks}, repeats=repeats
    )
    full = seconds["full"]
    return {
        label: {"slim_cost_1": per_n[1] / full[1], "slim_cost_block": per_n[block_tokens] / full[block_tokens],
                "seconds_1": per_n[1], "seconds_block": per_n[block_tokens]}  # fmt: skip
        for label, per_n in seconds.items()
        if label != "full"
    }


def search_budgets(
    target: nn.Module, reference: TeacherForcedReference, ratios: Sequence[float], time_budget: float | None, **settings: Any
) -> list[BudgetResult]:
    """Search every budget in turn; each gets an equal share of the time still left."""
    started = time.monotonic()
    results = []
    for index, ratio in enumerate(ratios):
        deadline = None
        if time_budget is not None:
            remaining = time_budget - (time.monotonic() - started)
            deadline = time.monotonic() + remaining / (len(ratios) - index)
        results.append(search_budget(target, reference, ratio, deadline=deadline, **settings))
    return results


def budget_rows(
    target: nn.Module,
    results: Sequence[BudgetResult],
    agreement_on: TeacherForcedReference,
    costs: Mapping[str, Mapping[str, float]] | None,
    block_tokens: int,
    alphas: Mapping[str, float],
) -> list[dict[str, Any]]:
    """Per budget: the mask found, its calibration and held-out scores, and (if measured) its cost."""
    rows = []
    for result in results:
        mask = RoutingMask.from_model(target, skip=list(result.skipped))
        agreement = score_mask(agreement_on, mask, **alphas)
        row = {"skip_ratio": result.skip_ratio, "skipped": result.skipped, "objective_value": result.value,
               "calibration": asdict(result.score), "heldout": asdict(agreement), "masks_evaluated": result.evaluated,
               "search_time_s": result.seconds, "stop_reason": result.stop_reason}  # fmt: skip
        if costs is not None:
            cost = costs[f"{result.skip_ratio:g}"]
            row |= cost
            row["predicted_speedup"] = predicted_speedup(cost["slim_cost_block"], agreement.top1, block_tokens - 1)
        rows.append(row)
    return rows
