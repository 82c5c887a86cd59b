"""The slim verifier's decision for each draft token: accept, regenerate, or escalate (docs/design.md, "The method")."""

from __future__ import annotations

from enum import Enum

import torch

from viasd_hf.config import ViaSDConfig


class Decision(Enum):
    """What the slim verifier does with one draft token."""

    ACCEPT = "accept"
    REGENERATE = "regenerate"
    ESCALATE = "escalate"


def forbidden(scores: torch.Tensor) -> torch.Tensor:
    """Where the logits processors forbid a token: a processed score of −inf (some use the dtype's lowest value)."""
    return scores <= torch.finfo(scores.dtype).min


def allowed_unscaled(logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Unscaled probabilities over the tokens the processors allow: softmax of the raw logits, 0 where forbidden.

    Tier thresholds compare these, so they mean the same at any temperature; a token that
    ``bad_words_ids``, ``min_new_tokens``, ``no_repeat_ngram_size``, ``suppress_tokens``, top-k, ...
    rule out has confidence 0: the slim tier never accepts it, and no cascade counts it as confident.
    """
    return logits.float().masked_fill(forbidden(scores), float("-inf")).softmax(-1)


def confidence(unscaled: torch.Tensor, token: int, signal: str) -> float:
    """How much a verifier believes ``token``: ``ratio`` is q′(d) / max q′, ``probability`` is q′(d)."""
    probability = unscaled[token].item()
    if signal == "ratio":
        return probability / unscaled.max().item()
    return probability


def decide(unscaled: torch.Tensor, token: int, config: ViaSDConfig) -> Decision:
    """Route one draft token; ties go to the more authoritative tier (see ``ViaSDConfig``).

    ``unscaled`` comes from ``allowed_unscaled``: a forbidden token scores 0 and is escalated.
    """
    score = confidence(unscaled, token, config.knobs.confidence)
    if score > config.knobs.tau_accept:
        return Decision.ACCEPT
    if score > config.knobs.tau_escalate:
        return Decision.REGENERATE
    return Decision.ESCALATE
