"""The slim verifier's decision for each draft token: accept, regenerate, or escalate (DESIGN §1)."""

from __future__ import annotations

from enum import Enum

import torch

from .config import ViaSDConfig


class Tier(Enum):
    ACCEPT = "accept"
    REGENERATE = "regenerate"
    ESCALATE = "escalate"


def confidence(slim_probs: torch.Tensor, token: int, signal: str) -> float:
    """How much the slim verifier believes ``token``: ``ratio`` is q′(d) / max q′, ``probability`` is q′(d)."""
    probability = slim_probs[token].item()
    if signal == "ratio":
        return probability / slim_probs.max().item()
    return probability


def decide(slim_probs: torch.Tensor, token: int, config: ViaSDConfig) -> Tier:
    """Route one draft token; ties go to the more authoritative tier (see ``ViaSDConfig``)."""
    score = confidence(slim_probs, token, config.confidence)
    if score > config.tau_accept:
        return Tier.ACCEPT
    if score > config.tau_escalate:
        return Tier.REGENERATE
    return Tier.ESCALATE
