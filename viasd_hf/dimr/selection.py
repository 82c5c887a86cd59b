"""Choosing among the search's best masks on validation windows, pooled and per task family.

A search that ranks hundreds of masks on the same calibration windows ends up fitting those
windows: its calibration best is, in part, the luckiest mask. So each budget's search
keeps its best few masks by calibration objective (the finalists) and the winner is the finalist
with the best objective on *validation* windows — prompts that the search never optimised on
and that are disjoint from the held-out prompts the finished mask is judged on
(``dimr.heldout``). When the validation prompts come in task families (the stratified corpus),
each family also gets its own winner: the finalist with the best objective on that family's
validation windows, written to ``family_masks.json`` (``dimr.family_masks``).

Ties go to the finalist that is better on calibration, so with one finalist the selection is the
calibration best.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from viasd_hf.calibration.windows import TeacherForcedReference, Window
from viasd_hf.dimr.objectives import MaskScore, pooled, window_scores
from viasd_hf.masks.routing_mask import RoutingMask


@dataclass(frozen=True)
class Finalist:
    """One of a budget's best masks by calibration objective, with its validation scores."""

    skipped: tuple[int, ...]
    calibration_rank: int  # 1 = the calibration best
    calibration: MaskScore
    validation: MaskScore  # every validation window, pooled
    families: dict[str, MaskScore]  # per task family; empty when the validation prompts have none

    def record(self, objective: str) -> dict[str, Any]:
        """The finalist as the search log and the mask's metadata record it."""
        return {
            "skipped": list(self.skipped),
            "calibration_rank": self.calibration_rank,
            "calibration": asdict(self.calibration),
            "validation": asdict(self.validation),
            "calibration_objective": self.calibration.objective(objective),
            "validation_objective": self.validation.objective(objective),
            "family_validation_objective": {f: s.objective(objective) for f, s in self.families.items()},
        }


@dataclass(frozen=True)
class Selection:
    """A budget's finalists and the masks chosen among them on validation windows."""

    objective: str
    finalists: tuple[Finalist, ...]  # in calibration order, best first
    winner: Finalist
    family_winners: dict[str, Finalist]

    def reason(self) -> str:
        """Why the winner won, in one sentence: its validation objective against the calibration best's."""
        name, winner, first = self.objective, self.winner, self.finalists[0]
        head = (
            f"skips {list(winner.skipped)}: lowest pooled validation {name} ({winner.validation.objective(name):.4f}, "
            f"{winner.validation.positions} positions) of {len(self.finalists)} finalists"
        )
        if winner is first:
            return f"{head}; it is also the calibration best ({first.calibration.objective(name):.4f})"
        return (
            f"{head}; calibration rank {winner.calibration_rank} ({winner.calibration.objective(name):.4f}), while the "
            f"calibration best {list(first.skipped)} ({first.calibration.objective(name):.4f}) scores "
            f"{first.validation.objective(name):.4f} on validation"
        )

    def record(self) -> dict[str, Any]:
        """The selection for the mask's metadata and the search log."""
        return {
            "objective": self.objective,
            "rule": "lowest pooled validation objective among the finalists (ties: better calibration rank)",
            "reason": self.reason(),
            "winner": list(self.winner.skipped),
            "family_winners": {family: list(f.skipped) for family, f in self.family_winners.items()},
            "finalists": [f.record(self.objective) for f in self.finalists],
        }


def family_of_windows(windows: Sequence[Window], families: Mapping[str, str]) -> list[str]:
    """Each window's task family, by its prompt id; every window must have one."""
    missing = sorted({w.prompt_id for w in windows if w.prompt_id not in families})
    if missing:
        raise ValueError(f"validation prompts without a task family: {missing[:5]}; pass families for every prompt id")
    return [families[w.prompt_id] for w in windows]


def select_on_validation(
    validation: TeacherForcedReference,
    finalists: Sequence[tuple[tuple[int, ...], MaskScore]],
    objective: str,
    families: Mapping[str, str] | None = None,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
) -> Selection:
    """Score every finalist on the validation windows; pick the pooled winner and (given ``families``) each family's.

    ``finalists`` are ``(skipped layers, calibration score)`` pairs, best calibration first, as
    ``BudgetResult.finalists`` holds them; ``families`` maps validation prompt ids to task families.
    """
    if not finalists:
        raise ValueError("no finalists to select from; search at least one mask first")
    labels = family_of_windows(validation.windows, families) if families else []
    scored = []
    for rank, (skip, calibration) in enumerate(finalists, start=1):
        per_window = window_scores(validation, RoutingMask.from_model(validation.model, skip=list(skip)), alpha1, alpha2)
        by_family = {f: pooled([s for s, label in zip(per_window, labels) if label == f]) for f in dict.fromkeys(labels)}
        scored.append(Finalist(tuple(skip), rank, calibration, pooled(per_window), by_family))
    winner = min(scored, key=lambda f: f.validation.objective(objective))  # min keeps the first of equals
    family_winners = {
        family: min(scored, key=lambda f, family=family: f.families[family].objective(objective))
        for family in dict.fromkeys(labels)
    }
    return Selection(objective, tuple(scored), winner, family_winners)
