"""DIMR at one skip budget: alternate BO and random proposals, memoised, until a stopping rule fires."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from torch import nn
from tqdm.auto import tqdm

from viasd_hf.calibration.windows import TeacherForcedReference
from viasd_hf.dimr.objectives import MaskScore, score_mask
from viasd_hf.dimr.proposals import Proposals
from viasd_hf.dimr.search_log import SearchLog
from viasd_hf.dimr.space import skip_count, skippable_layers
from viasd_hf.masks.architectures import num_decoder_layers
from viasd_hf.masks.routing_mask import RoutingMask


@dataclass(frozen=True)
class BudgetResult:
    """The best mask found at one skip budget and what finding it took.

    ``finalists`` are the best masks by calibration objective, best first (``skipped`` is the
    first), for a selection on validation windows to choose among (``dimr.selection``).
    """

    skip_ratio: float
    skipped: tuple[int, ...]
    value: float
    score: MaskScore
    evaluated: int
    seconds: float
    stop_reason: str
    finalists: tuple[tuple[tuple[int, ...], MaskScore], ...] = ()


def search_budget(
    target: nn.Module,
    reference: TeacherForcedReference,
    skip_ratio: float,
    objective: str = "via",
    iterations: int = 100,
    bo_every: int = 2,
    patience: int | None = 30,
    deadline: float | None = None,
    seed: int = 0,
    alpha1: float = 0.5,
    alpha2: float = 0.3,
    log: SearchLog | None = None,
    progress: bool = True,
    finalists: int = 1,
) -> BudgetResult:
    """DIMR at one budget: alternate BO and random proposals, memoised, until a stopping rule fires.

    ``deadline`` is a ``time.monotonic()`` value (at least one mask is always evaluated);
    ``patience`` counts evaluations without a new best; the best ``finalists`` masks are returned.
    """
    k = skip_count(target, skip_ratio)
    proposals = Proposals(skippable_layers(target), k, seed)
    log = log or SearchLog(None)
    seen: dict[tuple[int, ...], float] = {}
    scores: dict[tuple[int, ...], MaskScore] = {}
    best: tuple[tuple[int, ...], float, MaskScore] | None = None
    since_best, stop_reason = 0, "iterations"
    started = time.monotonic()
    bar = tqdm(total=iterations, desc=f"DIMR skip {k}/{num_decoder_layers(target)}", unit="mask", disable=not progress)
    for iteration in range(iterations):
        if deadline is not None and seen and time.monotonic() >= deadline:
            stop_reason = "time_budget"
            break
        if len(seen) >= proposals.total:
            stop_reason = "exhausted"
            break
        source, proposal = "bo", None
        if iteration % bo_every == 0:
            proposal = proposals.bayesian(seen)
        if proposal is None:
            source, proposal = "random", proposals.random(seen, best[0] if best else None)
        skip, point = proposal
        evaluated_at = time.monotonic()
        score = score_mask(reference, RoutingMask.from_model(target, skip=list(skip)), alpha1, alpha2)
        value = score.objective(objective)
        seen[skip], scores[skip] = value, score
        proposals.observe(point, value, fit=(iteration + 1) % bo_every == 0)
        if best is None or value < best[1]:
            best, since_best = (skip, value, score), 0
        else:
            since_best += 1
        log.write(
            {"skip_ratio": skip_ratio, "k": k, "iteration": iteration, "proposal": source, "skipped": skip,
             "objective": value, **asdict(score), "seconds": time.monotonic() - evaluated_at,
             "elapsed": time.monotonic() - started, "best": best[1]}  # fmt: skip
        )
        bar.update()
        bar.set_postfix(best=f"{best[1]:.4f}", top1=f"{best[2].top1:.3f}", src=source)
        if patience is not None and since_best >= patience:
            stop_reason = "patience"
            break
    bar.close()
    assert best is not None  # iterations >= 1 and the first evaluation ignores the deadline
    ranked = sorted(seen, key=lambda skip: seen[skip])[:finalists]  # stable: ties keep evaluation order, best first
    return BudgetResult(skip_ratio, best[0], best[1], best[2], len(seen), time.monotonic() - started, stop_reason,
                        tuple((skip, scores[skip]) for skip in ranked))  # fmt: skip
