"""How far a slim verifier q′ is from the full model q: the divergences DIMR minimises, and Δ.

Every score is a mean per position over teacher-forced calibration windows, computed from one
slim pass against the full model's stored log q (``calibration.windows.TeacherForcedReference``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from viasd_hf.calibration.windows import TeacherForcedReference, Window
from viasd_hf.masks.architectures import model_config
from viasd_hf.masks.routing_mask import RoutingMask

OBJECTIVES = ("via", "kl", "top1")


def kl_divergence(log_q: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """KL(q‖r) per position, for log-probabilities over the last dimension."""
    return (log_q.exp() * (log_q - log_r)).sum(-1)


def top1_agreement(log_q: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """1.0 where both distributions put their maximum on the same token."""
    return (log_q.argmax(-1) == log_r.argmax(-1)).float()


def via_cost(log_q: torch.Tensor, log_r: torch.Tensor, alpha1: float = 0.5, alpha2: float = 0.3) -> torch.Tensor:
    """R(q‖r) per position, the KL-margin cost of docs/design.md, "DIMR" (our reconstruction of the paper's).

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


def window_scores(
    reference: TeacherForcedReference, mask: RoutingMask, alpha1: float = 0.5, alpha2: float = 0.3
) -> list[MaskScore]:
    """One slim pass per window; each window's KL, top-1 agreement and VIA cost against the stored full model."""
    scores = []
    for log_q, log_slim in reference.log_prob_pairs(mask):
        positions = log_q.shape[0]
        scores.append(MaskScore(kl_divergence(log_q, log_slim).sum().item() / positions,
                                top1_agreement(log_q, log_slim).sum().item() / positions,
                                via_cost(log_q, log_slim, alpha1, alpha2).sum().item() / positions, positions))  # fmt: skip
    return scores


def pooled(scores: Sequence[MaskScore]) -> MaskScore:
    """Several windows' (or families') scores as one, weighted by their positions."""
    positions = sum(s.positions for s in scores)
    mean = {name: sum(getattr(s, name) * s.positions for s in scores) / positions for name in ("kl", "top1", "via")}
    return MaskScore(positions=positions, **mean)


def score_mask(reference: TeacherForcedReference, mask: RoutingMask, alpha1: float = 0.5, alpha2: float = 0.3) -> MaskScore:
    """KL, top-1 agreement and VIA cost of ``mask`` over all of ``reference``'s windows (one slim pass each)."""
    return pooled(window_scores(reference, mask, alpha1, alpha2))


def as_reference(target: nn.Module, windows: TeacherForcedReference | Sequence[Window]) -> TeacherForcedReference:
    """``windows`` with the full model's pass over them: a reference is reused, bare windows get one pass now."""
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
