"""DIMR: searching which decoder layers the slim verifier q′ skips (VIA-SD, DESIGN §2).

The search space is every way of skipping exactly k = round(s·L) of the layers that may be skipped
(``architectures.protected_layers`` are always kept). A candidate is scored by one slim pass over
teacher-forced calibration windows against the full model's stored log q
(``calibration.TeacherForcedReference``). Candidates come, as in the paper, from Bayesian
optimisation (scikit-optimize's GP optimiser) at iterations ``o % bo_every == 0`` and from random
search otherwise; no mask is evaluated twice; the search stops on iterations, patience or time.

Given several budgets, each is searched and the one with the best *predicted speed-up* is kept,
using the slim/full cost measured on this machine and the held-out agreement
(``predicted_speedup``). With a drafter, the paper's insertion criterion Δ says whether the
intermediate tier is worth having at all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import shlex
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from skopt import Optimizer
from skopt.space import Real
from threadpoolctl import threadpool_limits
from torch import nn
from tqdm.auto import tqdm

from .architectures import model_config, num_decoder_layers, protected_layers
from .calibration import Calibration, TeacherForcedReference, Window, build_calibration
from .masks import RoutingMask
from .profiling import forward_seconds

OBJECTIVES = ("via", "kl", "top1")
LOG_FILENAME = "search_log.jsonl"
SPEEDUP_MODEL = (
    "predicted speed-up of the 3-tier block over the 2-tier baseline = 1 / (c + 1 - a^γ): every block pays "
    "one slim pass of cost c (measured slim/full time of a (γ+1)-token block over a cached context) and "
    "escalates to the full model unless the slim model's top-1 agrees with the full model's at all γ "
    "drafted positions (a = held-out top-1 agreement). Drafter cost and acceptance length are the same "
    "in both and left out; > 1 means the slim tier pays."
)


# --------------------------------------------------------------------------- objectives


def kl_divergence(log_q: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """KL(q‖r) per position, for log-probabilities over the last dimension."""
    return (log_q.exp() * (log_q - log_r)).sum(-1)


def top1_agreement(log_q: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """1.0 where both distributions put their maximum on the same token."""
    return (log_q.argmax(-1) == log_r.argmax(-1)).float()


def via_cost(log_q: torch.Tensor, log_r: torch.Tensor, alpha1: float = 0.5, alpha2: float = 0.3) -> torch.Tensor:
    """R(q‖r) per position, the KL-margin cost of DESIGN §2 (our reconstruction of the paper's).

    ``Σ_v r(v)·ReLU(z1(v)) + Σ_v q(v)·ReLU(z2(v))`` with ``z1 = log(1−α1) + log r − log q`` and
    ``z2 = log α2 + log r − log q``: it charges only where r over-weights a token by more than the
    margins the α-thresholded gates tolerate, unlike KL which charges every deviation.
    """
    ratio = log_r - log_q
    z1 = math.log(1 - alpha1) + ratio
    z2 = math.log(alpha2) + ratio
    return (log_r.exp() * z1.relu()).sum(-1) + (log_q.exp() * z2.relu()).sum(-1)


@dataclass(frozen=True)
class MaskScore:
    """Mean per-position agreement of a slim model with the full model over some windows."""

    kl: float
    top1: float
    via: float
    positions: int

    def objective(self, name: str) -> float:
        """The value DIMR minimises for objective ``name``."""
        return {"via": self.via, "kl": self.kl, "top1": 1.0 - self.top1}[name]


def score_mask(reference: TeacherForcedReference, mask: RoutingMask, alpha1: float = 0.5, alpha2: float = 0.3) -> MaskScore:
    """One slim pass per window; KL, top-1 agreement and VIA cost against the stored full model."""
    kl = top1 = via = 0.0
    positions = 0
    for log_q, log_slim in reference.log_prob_pairs(mask):
        kl += kl_divergence(log_q, log_slim).sum().item()
        top1 += top1_agreement(log_q, log_slim).sum().item()
        via += via_cost(log_q, log_slim, alpha1, alpha2).sum().item()
        positions += log_q.shape[0]
    return MaskScore(kl / positions, top1 / positions, via / positions, positions)


def as_reference(target: nn.Module, windows: TeacherForcedReference | Sequence[Window]) -> TeacherForcedReference:
    if isinstance(windows, TeacherForcedReference):
        return windows
    return TeacherForcedReference(target, windows, progress=False)


def evaluate_mask(
    target: nn.Module,
    mask: RoutingMask,
    windows: TeacherForcedReference | Sequence[Window],
    alpha1: float = 0.5,
    alpha2: float = 0.3,
) -> dict[str, float]:
    """``{kl, top1, via, positions}`` of ``mask`` on ``windows`` (pass a reference to reuse its full pass)."""
    return asdict(score_mask(as_reference(target, windows), mask, alpha1, alpha2))


def _common_vocab(log_a: torch.Tensor, log_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions restricted and renormalised to the shared leading part of their vocabularies."""
    width = min(log_a.shape[-1], log_b.shape[-1])
    if log_a.shape[-1] == log_b.shape[-1]:
        return log_a, log_b
    return log_a[..., :width].log_softmax(-1), log_b[..., :width].log_softmax(-1)


def insertion_criterion(
    reference: TeacherForcedReference,
    drafter: nn.Module,
    masks: Mapping[str, RoutingMask],
    alpha1: float = 0.5,
    alpha2: float = 0.3,
) -> dict[str, dict[str, float]]:
    """The paper's Δ = C(q‖p) − C(q′‖p) − C(q‖q′) per mask (means per position; the sign is the sum's).

    Δ > 0 says the slim verifier q′ sits "between" drafter p and target q: the two short hops cost
    less than the direct one, so a third tier is worth inserting.
    """
    target_vocab = model_config(reference.model).vocab_size
    drafter_vocab = model_config(drafter).vocab_size
    if target_vocab != drafter_vocab:
        warnings.warn(
            f"drafter vocabulary ({drafter_vocab}) differs from the target's ({target_vocab}); Δ is computed "
            f"on the first {min(target_vocab, drafter_vocab)} token ids, renormalised",
            stacklevel=2,
        )
    labels = list(masks)
    sums = {label: {"C(q||p)": 0.0, "C(q'||p)": 0.0, "C(q||q')": 0.0} for label in labels}
    positions = 0
    slim_passes = [reference.log_prob_pairs(masks[label]) for label in labels]
    for log_p, *pairs in zip(reference.drafter_log_probs(drafter), *slim_passes):
        positions += log_p.shape[0]
        for label, (log_q, log_slim) in zip(labels, pairs):
            q_vs_p = _common_vocab(log_q, log_p)
            slim_vs_p = _common_vocab(log_slim, log_p)
            sums[label]["C(q||p)"] += via_cost(*q_vs_p, alpha1, alpha2).sum().item()
            sums[label]["C(q'||p)"] += via_cost(*slim_vs_p, alpha1, alpha2).sum().item()
            sums[label]["C(q||q')"] += via_cost(log_q, log_slim, alpha1, alpha2).sum().item()
    result = {}
    for label, parts in sums.items():
        means = {name: value / positions for name, value in parts.items()}
        means["delta"] = means["C(q||p)"] - means["C(q'||p)"] - means["C(q||q')"]
        means["vocab"] = min(target_vocab, drafter_vocab)
        result[label] = means
    return result


# --------------------------------------------------------------------------- the search space and baselines


def skippable_layers(model: nn.Module) -> list[int]:
    """Layers a routing mask may skip: all but ``protected_layers``."""
    protected = protected_layers(model)
    return [layer for layer in range(num_decoder_layers(model)) if layer not in protected]


def skip_count(model: nn.Module, skip_ratio: float) -> int:
    """k = round(s·L) (halves round up), checked against the number of skippable layers."""
    k = math.floor(skip_ratio * num_decoder_layers(model) + 0.5)
    available = len(skippable_layers(model))
    if not 1 <= k <= available:
        raise ValueError(
            f"skip ratio {skip_ratio} means skipping {k} of {num_decoder_layers(model)} layers; "
            f"between 1 and {available} can be skipped on this model"
        )
    return k


def random_masks(model: nn.Module, k: int, n: int, seed: int = 0) -> list[RoutingMask]:
    """``n`` distinct uniformly random masks skipping ``k`` skippable layers (a search baseline)."""
    layers = skippable_layers(model)
    n = min(n, math.comb(len(layers), k))
    rng = random.Random(seed)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < n:
        skip = tuple(sorted(rng.sample(layers, k)))
        if skip not in chosen:
            chosen.append(skip)
    return [RoutingMask.from_model(model, skip=list(skip), metadata={"baseline": "random"}) for skip in chosen]


def early_exit_mask(model: nn.Module, k: int) -> RoutingMask:
    """Skip the last ``k`` skippable layers before the final one (the early-exit baseline)."""
    skip = skippable_layers(model)[-k:]
    return RoutingMask.from_model(model, skip=skip, metadata={"baseline": "early exit"})


# --------------------------------------------------------------------------- proposals


class Proposals:
    """Where the next candidate mask comes from: Bayesian optimisation or random search.

    BO runs over one score in [0, 1] per skippable layer; a point becomes a mask by skipping the
    k highest-scoring layers. Random search proposes uniform k-subsets at first and later mostly
    swaps one or two layers of the incumbent (the paper does not say which random search it
    uses; swaps spend a small evaluation budget better). Randomly proposed masks are told to
    the GP as their 0/1 indicator, a point that maps back to the same mask. The GP's linear
    algebra is tiny, so it runs single-threaded: extra BLAS threads only fight torch's.
    """

    BO_RETRIES = 3
    UNIFORM_SHARE = 0.3

    def __init__(self, layers: Sequence[int], k: int, seed: int, initial_points: int = 6):
        self.layers = list(layers)
        self.k = k
        self.total = math.comb(len(self.layers), k)
        self.rng = random.Random(seed)
        self.optimizer = Optimizer(
            [Real(0.0, 1.0) for _ in self.layers],
            base_estimator="GP",
            n_initial_points=initial_points,
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": 2000},
            random_state=seed,
        )

    def mask_of(self, scores: Sequence[float]) -> tuple[int, ...]:
        order = sorted(range(len(self.layers)), key=lambda i: (-scores[i], i))
        return tuple(sorted(self.layers[i] for i in order[: self.k]))

    def indicator(self, skip: tuple[int, ...]) -> list[float]:
        return [1.0 if layer in skip else 0.0 for layer in self.layers]

    def bayesian(self, seen: Mapping[tuple[int, ...], float]) -> tuple[tuple[int, ...], list[float]] | None:
        """A new mask from the GP, or ``None`` if it keeps proposing masks already evaluated."""
        for _ in range(self.BO_RETRIES):
            point = [float(v) for v in self.optimizer.ask()]
            skip = self.mask_of(point)
            if skip not in seen:
                return skip, point
            with threadpool_limits(1):
                self.optimizer.tell(point, seen[skip])  # teach it the known value; ask again
        return None

    def random(
        self, seen: Mapping[tuple[int, ...], float], incumbent: tuple[int, ...] | None
    ) -> tuple[tuple[int, ...], list[float]]:
        if incumbent is not None and self.rng.random() >= self.UNIFORM_SHARE:
            for _ in range(20):
                skip = self._swap(incumbent, self.rng.choice((1, 1, 2)))
                if skip not in seen:
                    return skip, self.indicator(skip)
        skip = self._uniform(seen)
        return skip, self.indicator(skip)

    def observe(self, point: list[float], value: float, fit: bool) -> None:
        """Record an evaluation; ``fit`` refits the GP (only needed before a BO proposal)."""
        with threadpool_limits(1):
            self.optimizer.tell(point, value, fit=fit)

    def _swap(self, incumbent: tuple[int, ...], count: int) -> tuple[int, ...]:
        kept = [layer for layer in self.layers if layer not in incumbent]
        count = min(count, len(kept), self.k)
        out = set(self.rng.sample(list(incumbent), count))
        new = set(self.rng.sample(kept, count))
        return tuple(sorted((set(incumbent) - out) | new))

    def _uniform(self, seen: Mapping[tuple[int, ...], float]) -> tuple[int, ...]:
        if self.total <= 5000:  # small space: draw among the unseen masks exactly
            unseen = [skip for skip in itertools.combinations(self.layers, self.k) if skip not in seen]
            return self.rng.choice(unseen)
        while True:
            skip = tuple(sorted(self.rng.sample(self.layers, self.k)))
            if skip not in seen:
                return skip


# --------------------------------------------------------------------------- the search loop


def to_json_safe(value: Any) -> Any:
    """``value`` with numpy/torch scalars and arrays, tuples and paths turned into JSON types."""
    if isinstance(value, Mapping):
        return {str(key): to_json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_json_safe(item) for item in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return to_json_safe(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


class SearchLog:
    """Every evaluated mask, in memory and (if ``path``) appended to ``search_log.jsonl`` as it happens."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        row = to_json_safe(row)
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")


@dataclass(frozen=True)
class BudgetResult:
    """The best mask found at one skip budget and what finding it took."""

    skip_ratio: float
    skipped: tuple[int, ...]
    value: float
    score: MaskScore
    evaluated: int
    seconds: float
    stop_reason: str


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
) -> BudgetResult:
    """DIMR at one budget: alternate BO and random proposals, memoised, until a stopping rule fires.

    ``deadline`` is a ``time.monotonic()`` value (at least one mask is always evaluated);
    ``patience`` counts evaluations without a new best.
    """
    k = skip_count(target, skip_ratio)
    proposals = Proposals(skippable_layers(target), k, seed)
    log = log or SearchLog(None)
    seen: dict[tuple[int, ...], float] = {}
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
        seen[skip] = value
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
    return BudgetResult(skip_ratio, best[0], best[1], best[2], len(seen), time.monotonic() - started, stop_reason)


# --------------------------------------------------------------------------- budget sweep


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


def _model_id(model: nn.Module | None) -> str:
    if model is None:
        return "self"
    return str(getattr(model_config(model), "_name_or_path", "") or type(model).__name__)


def _as_calibration(
    target: nn.Module, calibration: Calibration | Sequence[Window] | None, tokenizer: Any, progress: bool
) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    if calibration is not None:
        windows = list(calibration)
        return Calibration(windows, [], "given windows", max(w.positions for w in windows), max(w.start + 1 for w in windows))
    if tokenizer is None:
        raise ValueError("pass calibration windows, or a tokenizer to build them from the Spec-Bench prompts")
    return build_calibration(target, tokenizer, progress=progress)


def _search_budgets(
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


def _budget_rows(
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
    the rest. Held-out scores use ``calibration.heldout`` (the calibration windows if it has none).
    With ``out_dir`` the mask and ``search_log.jsonl`` are written there.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if bo_every < 1 or iterations < 1:
        raise ValueError(f"bo_every and iterations must be >= 1, got {bo_every} and {iterations}")
    sweep = not isinstance(skip_ratio, (int, float))
    ratios = [float(r) for r in skip_ratio] if sweep else [float(skip_ratio)]
    for ratio in ratios:
        skip_count(target, ratio)  # fail before any expensive work
    started = time.monotonic()
    alphas = dict(alpha1=alpha1, alpha2=alpha2)
    calibration = _as_calibration(target, calibration, tokenizer, progress)
    reference = TeacherForcedReference(target, calibration.windows, progress=progress)
    log = SearchLog(Path(out_dir) / LOG_FILENAME if out_dir is not None else None)
    results = _search_budgets(target, reference, ratios, time_budget, objective=objective, iterations=iterations,
                              bo_every=bo_every, patience=patience, seed=seed, log=log, progress=progress, **alphas)  # fmt: skip

    masks = {f"{r.skip_ratio:g}": RoutingMask.from_model(target, skip=list(r.skipped)) for r in results}
    costs = measure_slim_costs(target, masks, cost_context, block_tokens, cost_repeats) if sweep else None
    heldout = TeacherForcedReference(target, calibration.heldout, progress=False) if calibration.heldout else reference
    rows = _budget_rows(target, results, heldout, costs, block_tokens, alphas)
    if drafter is not None:
        for row, criterion in zip(rows, insertion_criterion(reference, drafter, masks, **alphas).values()):
            row["insertion"] = criterion
    chosen = max(range(len(rows)), key=lambda i: rows[i]["predicted_speedup"]) if sweep else 0
    best, row = results[chosen], rows[chosen]

    metadata: dict[str, Any] = {
        "heldout": row["heldout"],
        "agreement_windows": "held-out" if calibration.heldout else "calibration (no held-out prompts given)",
        "calibration_score": row["calibration"],
        "masks_evaluated": sum(r.evaluated for r in results),
        "masks_evaluated_at_budget": best.evaluated,
        "stop_reason": best.stop_reason,
        "requested_skip_ratio": best.skip_ratio,
        "calibration_prompt_ids": calibration.calibration_ids,
        "heldout_prompt_ids": calibration.heldout_ids,
        "dtype": str(next(target.parameters()).dtype),
        "search": {"iterations": iterations, "bo_every": bo_every, "patience": patience, "time_budget_s": time_budget,
                   "seed": seed, "optimizer": "skopt Optimizer(GP), top-k of per-layer scores"},  # fmt: skip
    }
    if sweep:
        metadata |= {"sweep": rows, "speedup_model": SPEEDUP_MODEL, "predicted_speedup": row["predicted_speedup"]}
    if drafter is not None:
        metadata["insertion"] = row["insertion"]
        if row["insertion"]["delta"] <= 0:
            warnings.warn(
                f"insertion criterion Δ = {row['insertion']['delta']:.4f} ≤ 0 for the chosen mask: the slim "
                f"verifier does not sit between {_model_id(drafter)} and the target; two tiers may be better",
                stacklevel=2,
            )
    if search_command:
        metadata["search_command"] = search_command
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
    return mask


# --------------------------------------------------------------------------- baselines comparison


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


# --------------------------------------------------------------------------- `viasd search`

_FLAGS = ("target", "drafter", "skip_ratio", "objective", "iterations", "bo_every", "patience", "time_budget", "seed",
          "prompts", "num_prompts", "num_heldout", "window", "max_prompt_tokens", "dtype", "out")  # fmt: skip


def _skip_ratios(text: str) -> float | list[float]:
    from .cli_args import skip_fractions

    values = skip_fractions(text)  # argparse reports a bad value as one line
    return values[0] if len(values) == 1 and "," not in text else values


def _slug(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


def add_search_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``viasd search``: find a routing mask with DIMR and save it with its search log."""
    from .cli_args import DTYPES, non_negative_int, positive_float, positive_int

    parser = subparsers.add_parser(
        "search",
        help="find the slim verifier's routing mask for a target (and drafter) with DIMR",
        description="Search which decoder layers the slim verifier skips (DIMR), then save routing_mask.json "
        "and search_log.jsonl to --out.",
    )
    parser.add_argument("--target", required=True, help="zoo name, Hub id or local folder")
    parser.add_argument("--drafter", help="drafter sharing the target's tokenizer (enables the Δ criterion); default: self")
    parser.add_argument("--skip-ratio", type=_skip_ratios, default=0.45,
                        help="fraction of layers to skip; a comma list (e.g. 0.1,0.15,0.2) sweeps budgets and keeps "
                        "the best predicted speed-up")  # fmt: skip
    parser.add_argument("--objective", choices=OBJECTIVES, default="via", help="via (KL-margin cost), kl, or top1")
    parser.add_argument("--iterations", type=positive_int, default=100, help="max masks evaluated per budget")
    parser.add_argument("--bo-every", type=positive_int, default=2,
                        help="propose by Bayesian optimisation when iteration %% N == 0")
    parser.add_argument("--patience", type=positive_int, default=30,
                        help="stop a budget after N evaluations without improvement")
    parser.add_argument("--time-budget", type=positive_float, help="seconds for the whole search (all budgets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", help="JSONL with a 'prompt' field, or text with one prompt per line (default: Spec-Bench)")
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="calibration prompts")
    parser.add_argument("--num-heldout", type=non_negative_int, default=16, help="held-out prompts (disjoint) for agreement")
    parser.add_argument("--window", type=positive_int, default=16, help="greedy continuation tokens scored per prompt (τ)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=384)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="the deployment dtype (costs are measured in it)")
    parser.add_argument("--out", help="output folder (default: masks/<target>/<drafter or self>)")
    parser.set_defaults(handler=run_search_command)
    return parser


def search_command_line(args: argparse.Namespace) -> str:
    """The ``viasd search`` command that reproduces ``args`` (every option spelled out)."""
    parts = ["viasd", "search"]
    for name in _FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(f"{v:g}" for v in value)
        parts += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def _check_search_args(args: argparse.Namespace) -> None:
    """What can be checked before the models load (minutes): models, the output folder, the prompts and their number."""
    from .calibration import read_prompts, spec_bench_prompts
    from .cli_args import UsageError, check_input_file, check_model, check_output_dir, first_line

    check_model(args.target, "--target")
    if args.drafter not in (None, "self"):
        check_model(args.drafter, "--drafter")
    check_output_dir(args.out, "--out")
    source = f"--prompts {args.prompts}" if args.prompts else "the default Spec-Bench prompts"
    try:
        pool = read_prompts(check_input_file(args.prompts, "--prompts")) if args.prompts else spec_bench_prompts()
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        if isinstance(error, IndexError):
            reason = "no prompts in the file"
        elif isinstance(error, KeyError):
            reason = f"a record has no {error} field (JSONL prompts need 'prompt')"
        else:
            reason = first_line(error)
        raise UsageError(f"{source}: {reason}") from None
    if len(pool) < args.num_prompts + args.num_heldout:
        raise UsageError(
            f"{source}: {len(pool)} prompts, fewer than --num-prompts {args.num_prompts} + --num-heldout "
            f"{args.num_heldout}"
        )


def run_search_command(args: argparse.Namespace) -> int:
    from .cli_args import load_model

    drafted = args.drafter not in (None, "self")  # `--drafter self` is the default: the target drafts for itself
    args.out = args.out or str(Path("masks") / _slug(args.target) / (_slug(args.drafter) if drafted else "self"))
    _check_search_args(args)
    target, tokenizer = load_model(args.target, args.dtype, "--target")
    drafter = load_model(args.drafter, args.dtype, "--drafter")[0] if drafted else None
    calibration = build_calibration(
        target, tokenizer, prompts=args.prompts, num_prompts=args.num_prompts, num_heldout=args.num_heldout,
        window=args.window, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
    )  # fmt: skip
    mask = search(
        target, drafter, calibration, skip_ratio=args.skip_ratio, objective=args.objective, iterations=args.iterations,
        bo_every=args.bo_every, patience=args.patience, time_budget=args.time_budget, seed=args.seed,
        out_dir=args.out, search_command=search_command_line(args),
    )  # fmt: skip
    heldout = mask.metadata.get("heldout") or {}
    print(
        f"skip {mask.skipped_layers} of {mask.num_layers} layers; {mask.objective} = {mask.objective_value:.4f}; "
        f"held-out top-1 {heldout.get('top1', float('nan')):.3f}, KL {heldout.get('kl', float('nan')):.3f}; "
        f"{mask.metadata['masks_evaluated']} masks in {mask.search_time_s:.0f}s -> {args.out}"
    )
    return 0
