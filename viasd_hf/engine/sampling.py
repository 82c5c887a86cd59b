"""Exact speculative sampling, and the speculative-cascade target the slim tier samples from (docs/design.md, "The method").

Every distribution here is the *processed* one (temperature, top-k, top-p and other logits
processors applied), because that is what tokens are actually drawn from; handing a verifier
raw probabilities instead breaks exactness (HF bug #47932). Only the slim tier's confidence set
is defined on unscaled probabilities, so the thresholds mean the same at any temperature.

Every random draw takes the call's ``RandomStream``, never torch's global generator, so a seeded
call draws the same numbers whatever else in the process draws from the global one.
"""

from __future__ import annotations

import torch


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    """The proposal of a deterministic drafter (prompt lookup): all mass on the drafted token."""
    proposal = torch.zeros_like(like)
    proposal[token] = 1.0
    return proposal


class RandomStream:
    """One ``generate`` call's private random numbers.

    Its seed is drawn once from torch's global generator when the call starts, so
    ``torch.manual_seed(s)`` before ``generate`` fixes every draw of the call; after that, nothing
    else that draws from the global generator (another thread, a dropout layer) shifts them. A
    ``torch.Generator`` serves one device, so there is one per device the call samples on (a drafter
    may live on another device than the target), each seeded alike.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_global_seed(cls) -> RandomStream:
        return cls(int(torch.randint(2**62, ())))

    def on(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]


def sample(probs: torch.Tensor, rng: RandomStream) -> int:
    return int(torch.multinomial(probs, 1, generator=rng.on(probs.device)))


def residual(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, target − proposal))``: what a rejected token is resampled from."""
    leftover = (target - proposal).clamp(min=0)
    total = leftover.sum()
    return leftover / total if total > 0 else target


def rejection_step(token: int, proposal: torch.Tensor, target: torch.Tensor, rng: RandomStream) -> int | None:
    """Accept ``token ~ proposal`` with probability ``min(1, target/proposal)``; ``None`` means accepted.

    On rejection the returned token is drawn from the residual, so the result is distributed
    exactly as ``target`` whatever the proposal was.
    """
    uniform = torch.rand((), device=proposal.device, generator=rng.on(proposal.device))
    if uniform * proposal[token] < target[token]:
        return None
    return sample(residual(target, proposal), rng)


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
