"""DIMR: searching which decoder layers the slim verifier q′ skips (VIA-SD, docs/design.md, "DIMR").

The search space is every way of skipping exactly k = round(s·L) of the layers that may be skipped
(``architectures.protected_layers`` are always kept). A candidate is scored by one slim pass over
teacher-forced calibration windows against the full model's stored log q
(``calibration.windows.TeacherForcedReference``). Candidates come, as in the paper, from Bayesian
optimisation (scikit-optimize's GP optimiser) at iterations ``o % bo_every == 0`` and from random
search otherwise; no mask is evaluated twice; the search stops on iterations, patience or time.

Given several budgets, each is searched and the one with the best *predicted speed-up* is kept,
using the slim/full cost measured on this machine and the held-out agreement
(``predicted_speedup``). With a drafter, the paper's insertion criterion Δ says whether the
intermediate tier is worth having at all.

Modules: ``objectives`` (scores and Δ), ``space`` (skippable layers, baseline masks),
``proposals`` (BO and random search), ``budget`` (the loop at one budget), ``sweep`` (several
budgets, costs, predicted speed-up), ``mask_search`` (:func:`search`, end to end),
``search_log`` (the JSONL log), ``selection`` (the winner among the best masks, chosen on validation
windows, overall and per task family), ``family_masks`` (``family_masks.json``), ``report`` (a mask against the baselines), ``heldout`` (shipped
masks per task family on the stratified corpus's held-out split; ``python -m
viasd_hf.dimr.heldout``). ``viasd search`` is ``viasd_hf.cli.search``.
"""

from viasd_hf.dimr.budget import BudgetResult, search_budget
from viasd_hf.dimr.family_masks import FAMILY_MASKS_FILENAME, load_family_masks
from viasd_hf.dimr.mask_search import search
from viasd_hf.dimr.objectives import (
    OBJECTIVES,
    MaskScore,
    as_reference,
    evaluate_mask,
    insertion_criterion,
    kl_divergence,
    pooled,
    score_mask,
    top1_agreement,
    via_cost,
    window_scores,
)
from viasd_hf.dimr.proposals import Proposals
from viasd_hf.dimr.report import baseline_table, compare_with_baselines
from viasd_hf.dimr.search_log import LOG_FILENAME, SearchLog, to_json_safe
from viasd_hf.dimr.selection import Finalist, Selection, select_on_validation
from viasd_hf.dimr.space import early_exit_mask, random_masks, skip_count, skippable_layers
from viasd_hf.dimr.sweep import SPEEDUP_MODEL, measure_slim_costs, predicted_speedup

__all__ = [
    "FAMILY_MASKS_FILENAME",
    "LOG_FILENAME",
    "OBJECTIVES",
    "SPEEDUP_MODEL",
    "BudgetResult",
    "Finalist",
    "MaskScore",
    "Proposals",
    "SearchLog",
    "Selection",
    "as_reference",
    "baseline_table",
    "compare_with_baselines",
    "early_exit_mask",
    "evaluate_mask",
    "insertion_criterion",
    "kl_divergence",
    "load_family_masks",
    "measure_slim_costs",
    "pooled",
    "predicted_speedup",
    "random_masks",
    "score_mask",
    "search",
    "search_budget",
    "select_on_validation",
    "skip_count",
    "skippable_layers",
    "to_json_safe",
    "top1_agreement",
    "via_cost",
    "window_scores",
]
