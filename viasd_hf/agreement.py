"""How closely the slim verifier follows the full model on a given token sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .masks import RoutingMask
from .routing import routed


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced agreement of slim and full model over ``positions`` next-token predictions."""

    top1: float
    kl: float
    positions: int


@torch.no_grad()
def teacher_forced_agreement(model: nn.Module, mask: RoutingMask, sequence: torch.Tensor, start: int) -> Agreement:
    """Top-1 agreement and mean KL(full ‖ slim) at the predictions of tokens ``sequence[:, start:]``.

    Both passes see the same (full model's) tokens, so this measures the slim tier's error in
    isolation rather than compounding it along its own continuation.
    """
    if sequence.shape[0] != 1:
        raise ValueError(f"teacher_forced_agreement takes one sequence, got a batch of {sequence.shape[0]}")
    if not 0 < start < sequence.shape[1]:
        raise ValueError(f"start={start} must lie inside the sequence of length {sequence.shape[1]}")
    full_logits = model(sequence, use_cache=False).logits[0, start - 1 : -1].float()
    with routed(model, mask):
        slim_logits = model(sequence, use_cache=False).logits[0, start - 1 : -1].float()
    full_logp, slim_logp = full_logits.log_softmax(-1), slim_logits.log_softmax(-1)
    kl = (full_logp.exp() * (full_logp - slim_logp)).sum(-1).mean().item()
    top1 = (full_logits.argmax(-1) == slim_logits.argmax(-1)).float().mean().item()
    return Agreement(top1=top1, kl=kl, positions=full_logits.shape[0])
