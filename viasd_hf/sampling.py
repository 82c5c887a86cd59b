"""Exact speculative sampling, and the speculative-cascade target the slim tier samples from (DESIGN §1).

Every distribution here is the *processed* one (temperature, top-k, top-p and other logits
processors applied), because that is what tokens are actually drawn from; handing a verifier
raw probabilities instead breaks exactness (HF bug #47932). Only the slim tier's confidence set
is defined on unscaled probabilities, so the thresholds mean the same at any temperature.
"""

from __future__ import annotations

import torch


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    """The proposal of a deterministic drafter (prompt lookup): all mass on the drafted token."""
    proposal = torch.zeros_like(like)
    proposal[token] = 1.0
    return proposal


def sample(probs: torch.Tensor) -> int:
    return int(torch.multinomial(probs, 1))


def residual(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, target − proposal))``: what a rejected token is resampled from."""
    leftover = (target - proposal).clamp(min=0)
    total = leftover.sum()
    return leftover / total if total > 0 else target


def rejection_step(token: int, proposal: torch.Tensor, target: torch.Tensor) -> int | None:
    """Accept ``token ~ proposal`` with probability ``min(1, target/proposal)``; ``None`` means accepted.

    On rejection the returned token is drawn from the residual, so the result is distributed
    exactly as ``target`` whatever the proposal was.
    """
    if torch.rand(()) * proposal[token] < target[token]:
        return None
    return sample(residual(target, proposal))


def cascade_target(
    draft_probs: torch.Tensor, slim_probs: torch.Tensor, slim_unscaled: torch.Tensor, tau: float
) -> torch.Tensor:
    """``π = p·1[A] + (1 − p(A))·q′`` with ``A = {v : q′(v) > τ · max q′}`` on unscaled slim probabilities.

    The drafter keeps its mass on tokens the slim verifier finds plausible; the rest goes to the
    slim verifier's own distribution. ``τ = 1`` gives ``π = q′``; ``τ = 0`` leaves ``p`` untouched on
    the slim verifier's support.
    """
    confident = slim_unscaled > tau * slim_unscaled.max()
    kept = draft_probs * confident
    return kept + (1.0 - kept.sum()) * slim_probs


def cascade_step(
    token: int, proposal: torch.Tensor, probs: torch.Tensor, unscaled: torch.Tensor, tau: float
) -> tuple[torch.Tensor, int | None]:
    """One rejection step of a drafted ``token ~ proposal`` against the cascade target π of a verifier.

    Returns π (the distribution the committed token follows) and the resampled token, ``None``
    when the draft was kept.
    """
    target = cascade_target(proposal, probs, unscaled, tau)
    return target, rejection_step(token, proposal, target)
