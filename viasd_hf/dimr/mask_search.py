"""DIMR end to end: calibration windows, one search per budget, the winners weighed, one RoutingMask out.

Named ``mask_search`` rather than ``search`` so that ``viasd_hf.dimr.search`` stays the function.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from viasd_hf.calibration.windows import Calibration, TeacherForcedReference, Window, build_calibration
from viasd_hf.dimr.budget import BudgetResult
from viasd_hf.dimr.family_masks import family_masks_record, write_family_masks
from viasd_hf.dimr.objectives import OBJECTIVES, insertion_criterion
from viasd_hf.dimr.search_log import LOG_FILENAME, SearchLog, to_json_safe
from viasd_hf.dimr.selection import Selection, select_on_validation
from viasd_hf.dimr.space import skip_count
from viasd_hf.dimr.sweep import SPEEDUP_MODEL, budget_rows, measure_slim_costs, search_budgets
from viasd_hf.masks.architectures import model_config, num_decoder_layers
from viasd_hf.masks.routing_mask import RoutingMask


def search(
    target: nn.Module,
    drafter: nn.Module | None = None,
    calibration: Calibration | Sequence[Window] | None = None,
    skip_ratio: float | Sequence[float] = 0.45,
    objective: str = "via",
    iterations: int = 100,
    bo_every: int = 2,
    patience: int | None = 30,
    time_budget: float | None = None,
    seed: int = 0,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
    finalists: int = 8,
    *,
    tokenizer: Any = None,
    out_dir: str | Path | None = None,
    search_command: str | None = None,
    progress: bool = True,
    cost_context: int = 300,
    block_tokens: int = 6,
    cost_repeats: int = 5,
) -> RoutingMask:
    """Find the routing mask of ``target``'s slim verifier with DIMR.

    ``skip_ratio`` a float searches one budget; a list sweeps budgets, measures each winner's cost
    on this machine and keeps the best predicted speed-up (recorded in ``metadata["sweep"]``).
    ``time_budget`` (seconds) covers all budgets; a budget that stops early leaves its time to
    the rest. Each budget keeps its best ``finalists`` masks by calibration objective, and the one
    with the best objective on the validation windows ``calibration.heldout`` wins
    (``dimr.selection``); without validation windows the calibration best wins and agreement is
    measured on the calibration windows. With ``out_dir`` the mask and ``search_log.jsonl`` are
    written there, and ``family_masks.json`` too when the validation prompts have task families.
    """
    sweep = not isinstance(skip_ratio, (int, float))
    ratios = _checked_ratios(target, skip_ratio, sweep, objective, iterations, bo_every, finalists)
    started = time.monotonic()
    alphas = dict(alpha1=alpha1, alpha2=alpha2)
    calibration = _as_calibration(target, calibration, tokenizer, progress)
    reference = TeacherForcedReference(target, calibration.windows, progress=progress)
    log = SearchLog(Path(out_dir) / LOG_FILENAME if out_dir is not None else None)
    results = search_budgets(target, reference, ratios, time_budget, objective=objective, iterations=iterations,
                             bo_every=bo_every, patience=patience, seed=seed, log=log, progress=progress,
                             finalists=finalists, **alphas)  # fmt: skip
    validation = TeacherForcedReference(target, calibration.heldout, progress=False) if calibration.heldout else None
    selections = [_select(validation, result, objective, calibration.families, alphas, log) for result in results]
    results = [_as_selected(result, selection, objective) for result, selection in zip(results, selections)]
    rows = _winner_rows(target, drafter, validation or reference, reference, results, alphas, sweep=sweep,
                        cost_context=cost_context, block_tokens=block_tokens, cost_repeats=cost_repeats)  # fmt: skip
    for row, selection in zip(rows, selections):
        if selection is not None:
            row["selection"] = selection.record()
    chosen = max(range(len(rows)), key=lambda i: rows[i]["predicted_speedup"]) if sweep else 0
    settings = {"iterations": iterations, "bo_every": bo_every, "patience": patience, "time_budget_s": time_budget,
                "seed": seed, "finalists": finalists, "optimizer": "skopt Optimizer(GP), top-k of per-layer scores"}  # fmt: skip
    metadata = _metadata(target, calibration, results, rows, chosen, settings, sweep=sweep, search_command=search_command)
    if drafter is not None:
        _warn_if_not_between(drafter, metadata["insertion"]["delta"])
    best = results[chosen]
    mask = RoutingMask.from_model(
        target,
        skip=list(best.skipped),
        drafter_id=_model_id(drafter),
        objective=objective,
        objective_value=best.value,
        skip_ratio=round(len(best.skipped) / num_decoder_layers(target), 4),
        calibration=calibration.describe(),
        search_time_s=round(time.monotonic() - started, 1),
        metadata=to_json_safe(metadata),
        **alphas,
    )
    if out_dir is not None:
        mask.save_pretrained(out_dir)
        selection = selections[chosen]
        if selection is not None and selection.family_winners:
            record = family_masks_record(mask, selection, calibration.families, calibration.heldout_ids)
            write_family_masks(out_dir, to_json_safe(record))
    return mask


def _select(
    validation: TeacherForcedReference | None,
    result: BudgetResult,
    objective: str,
    families: Mapping[str, str],
    alphas: Mapping[str, float],
    log: SearchLog,
) -> Selection | None:
    """The budget's finalists scored on the validation windows, each logged, and the winners; ``None`` without any."""
    if validation is None:
        return None
    selection = select_on_validation(validation, result.finalists, objective, families or None, **alphas)
    k = len(result.skipped)
    for finalist in selection.finalists:
        log.write({"phase": "validation", "skip_ratio": result.skip_ratio, "k": k, **finalist.record(objective)})
    log.write({"phase": "selection", "skip_ratio": result.skip_ratio, "k": k, **selection.record()})
    return selection


def _as_selected(result: BudgetResult, selection: Selection | None, objective: str) -> BudgetResult:
    """``result`` with the validation winner in place of the calibration best (unchanged without a selection)."""
    if selection is None:
        return result
    winner = selection.winner
    return replace(result, skipped=winner.skipped, value=winner.calibration.objective(objective), score=winner.calibration)


def _checked_ratios(
    target: nn.Module,
    skip_ratio: float | Sequence[float],
    sweep: bool,
    objective: str,
    iterations: int,
    bo_every: int,
    finalists: int,
) -> list[float]:
    """The budgets to search, with every setting checked before any expensive work."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if bo_every < 1 or iterations < 1 or finalists < 1:
        raise ValueError(f"bo_every, iterations and finalists must be >= 1, got {bo_every}, {iterations} and {finalists}")
    ratios = [float(r) for r in skip_ratio] if sweep else [float(skip_ratio)]
    for ratio in ratios:
        skip_count(target, ratio)
    return ratios


def _as_calibration(
    target: nn.Module, calibration: Calibration | Sequence[Window] | None, tokenizer: Any, progress: bool
) -> Calibration:
    """A ``Calibration`` from what the caller gave: one as is, bare windows, or nothing (Spec-Bench prompts)."""
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is not None:
        windows = list(calibration)
        return Calibration(windows, [], "given windows", max(w.positions for w in windows), max(w.start + 1 for w in windows))
    if tokenizer is None:
        raise ValueError("pass calibration windows, or a tokenizer to build them from the Spec-Bench prompts")
    return build_calibration(target, tokenizer, progress=progress)


def _winner_rows(
    target: nn.Module,
    drafter: nn.Module | None,
    agreement_on: TeacherForcedReference,
    reference: TeacherForcedReference,
    results: Sequence[BudgetResult],
    alphas: Mapping[str, float],
    *,
    sweep: bool,
    cost_context: int,
    block_tokens: int,
    cost_repeats: int,
) -> list[dict[str, Any]]:
    """Each budget's winner scored on ``agreement_on``, timed when sweeping, and with Δ when there is a drafter."""
    masks = {f"{r.skip_ratio:g}": RoutingMask.from_model(target, skip=list(r.skipped)) for r in results}
    costs = measure_slim_costs(target, masks, cost_context, block_tokens, cost_repeats) if sweep else None
    rows = budget_rows(target, results, agreement_on, costs, block_tokens, alphas)
    if drafter is not None:
        for row, criterion in zip(rows, insertion_criterion(reference, drafter, masks, **alphas).values()):
            row["insertion"] = criterion
    return rows


def _metadata(
    target: nn.Module,
    calibration: Calibration,
    results: Sequence[BudgetResult],
    rows: Sequence[dict[str, Any]],
    chosen: int,
    settings: dict[str, Any],
    *,
    sweep: bool,
    search_command: str | None,
) -> dict[str, Any]:
    """What the saved mask records about how budget ``chosen`` won, so that the search can be judged and redone."""
    best, row = results[chosen], rows[chosen]
    metadata: dict[str, Any] = {
        "heldout": row["heldout"],
        "agreement_windows": "validation (the windows the winner was selected on; judge it on dimr.heldout's)"
        if calibration.heldout else "calibration (no held-out prompts given)",
        "calibration_score": row["calibration"],
        "masks_evaluated": sum(r.evaluated for r in results),
        "masks_evaluated_at_budget": best.evaluated,
        "stop_reason": best.stop_reason,
        "requested_skip_ratio": best.skip_ratio,
        "calibration_prompt_ids": calibration.calibration_ids,
        "heldout_prompt_ids": calibration.heldout_ids,
        "dtype": str(next(target.parameters()).dtype),
        "search": settings,
    }
    if "selection" in row:
        metadata["selection"] = row["selection"]
    if sweep:
        metadata |= {"sweep": rows, "speedup_model": SPEEDUP_MODEL, "predicted_speedup": row["predicted_speedup"]}
    if "insertion" in row:  # there was a drafter
        metadata["insertion"] = row["insertion"]
    if search_command:
        metadata["search_command"] = search_command
    return metadata


def _warn_if_not_between(drafter: nn.Module, delta: float) -> None:
    """Δ ≤ 0: the slim tier does not sit between drafter and target, so the caller may be better off with two tiers."""
    if delta <= 0:
        warnings.warn(
            f"insertion criterion Δ = {delta:.4f} ≤ 0 for the chosen mask: the slim "
            f"verifier does not sit between {_model_id(drafter)} and the target; two tiers may be better",
            stacklevel=3,  # the caller of ``search``
        )


def _model_id(model: nn.Module | None) -> str:
    if model is None:
        return "self"
    return str(getattr(model_config(model), "_name_or_path", "") or type(model).__name__)
