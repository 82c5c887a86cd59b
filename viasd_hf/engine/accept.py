"""The one verification primitive: keep the longest prefix of a draft that a target accepts, then add its own token.

Every tier verifies the same way (gpt-fast's ``speculative_decode``, Leviathan et al.): walk the
draft, keep each token the target accepts, and at the first rejection commit the target's own
token instead; when every draft is kept, the target adds a bonus token. What differs between
tiers is only the *target* at each position:

- ``GreedyTarget``: the verifier's argmax, optionally lenient (a speculative cascade keeps a
  draft its verifier finds nearly as good; the slim verifier keeps a draft it is confident in).
  This is rejection sampling against a one-hot target: a draft is kept iff it is the target's
  token (or deemed as good), and the residual of a one-hot is that token.
- ``SampledTarget``: exact rejection sampling against the verifier's processed distribution, or
  against the speculative-cascade target π built from it (``sampling.cascade_target``).

The slim tier adds an escalation predicate: a draft it is unsure of ends its walk without a
verdict, and the full model decides (docs/design.md, "The method").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from viasd_hf.engine.sampling import RandomStream, cascade_target, one_hot, rejection_step, sample


@dataclass
class Draft:
    """Proposed tokens, the processed distribution each was drawn from (``None`` when not drawn from a model), and
    the drafter's forward passes that made them. A greedy model drafter also keeps, at each position, its second
    choice there (``None`` where the processors allow only one token): a candidate the full model can verify beside
    the draft (``engine.batch.second_choices``)."""

    tokens: list[int]
    probs: list[torch.Tensor | None]
    forwards: int = 0
    second: list[int | None] = field(default_factory=list)

    @property
    def drawn(self) -> bool:
        """Whether a model drew every token (a copied draft says nothing about a drafter's confidence)."""
        return bool(self.tokens) and all(probs is not None for probs in self.probs)

    @property
    def confidences(self) -> list[float]:
        """The drafter's probability of each token it drafted (1 for a deterministic draft)."""
        return [1.0 if probs is None else probs[token].item() for token, probs in zip(self.tokens, self.probs)]

    @property
    def second_confidences(self) -> list[float | None]:
        """The drafter's probability of its second choice at each position (``None`` where it has none)."""
        return [None if token is None or probs is None else probs[token].item()
                for token, probs in zip(self.second, self.probs)]


@dataclass
class Verdict:
    """How far a target kept a draft: ``kept`` leading tokens, then ``token`` (its replacement, or its bonus when
    every draft was kept); ``token`` is ``None`` when the walk stopped at ``kept`` by escalating."""

    kept: int
    token: int | None

    @property
    def escalated(self) -> bool:
        return self.token is None


class Target(Protocol):
    def check(self, position: int, token: int, proposal: torch.Tensor | None) -> int | None:
        """``None`` to keep the drafted ``token`` (drawn from ``proposal``), else the token that replaces it."""

    def bonus(self, position: int) -> int:
        """The target's own token after a fully kept draft."""


Lenience = Callable[[int, int], bool]  # (position, token) -> keep the draft although it is not the verifier's choice


class GreedyTarget:
    """The verifier's argmax at each position; ``lenient`` names drafts it keeps all the same."""

    def __init__(self, scores: torch.Tensor, lenient: Lenience | None = None) -> None:
        self.choices = scores.argmax(-1).tolist()
        self.lenient = lenient

    def check(self, position: int, token: int, proposal: torch.Tensor | None) -> int | None:
        choice = self.choices[position]
        if token == choice or (self.lenient is not None and self.lenient(position, token)):
            return None
        return choice

    def bonus(self, position: int) -> int:
        return self.choices[position]


@dataclass
class CascadeSet:
    """The tokens a speculative cascade keeps from the drafter: unscaled probability above ``tau`` times the
    verifier's favourite's (``sampling.cascade_target``)."""

    unscaled: torch.Tensor
    tau: float


class SampledTarget:
    """Exact rejection sampling against the verifier's processed distribution, or the cascade target π built from
    it. ``followed`` records the distribution each checked position's committed token now follows: the proposal
    a later verifier must check it against."""

    def __init__(self, probs: torch.Tensor, rng: RandomStream, cascade: CascadeSet | None = None) -> None:
        self.probs = probs
        self.rng = rng
        self.cascade = cascade
        self.followed: list[torch.Tensor] = []

    def check(self, position: int, token: int, proposal: torch.Tensor | None) -> int | None:
        probs = self.probs[position]
        proposal = one_hot(token, probs) if proposal is None else proposal
        target = probs
        if self.cascade is not None:
            target = cascade_target(proposal, probs, self.cascade.unscaled[position], self.cascade.tau)
        self.followed.append(target)
        return rejection_step(token, proposal, target, self.rng)

    def bonus(self, position: int) -> int:
        return sample(self.probs[position], self.rng)


def accept_prefix(draft: Draft, target: Target, escalates: Lenience | None = None) -> Verdict:
    """Keep drafts while ``target`` accepts them; then its replacement, or its bonus after the last draft.

    ``escalates(position, token)`` stops the walk before judging that draft (the slim tier hands it up).
    """
    for position, token in enumerate(draft.tokens):
        if escalates is not None and escalates(position, token):
            return Verdict(kept=position, token=None)
        replacement = target.check(position, token, draft.probs[position])
        if replacement is not None:
            return Verdict(kept=position, token=replacement)
    return Verdict(kept=len(draft.tokens), token=target.bonus(len(draft.tokens)))
