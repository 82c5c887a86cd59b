"""Block policies: what the tiers make of one row's draft, as in the paper's algorithm.

- ``slim_walk``: tiered mode; the slim verifier walks the draft and commits on its own authority (``decided``), unless
  it is unsure of a draft: then the block escalates and the full model decides it (``after_slim_walk``). A probe of
  the slim tier in shadow walks the same way and commits nothing of its own.
- ``slim_repair``: lossless mode; the slim verifier may replace one draft (dropping those after it), then the full
  model verifies the block (``after_repair``); the output is the full model's own.
- without the slim tier, the full model verifies the draft (standard speculative decoding; with ``cascade_lenience``
  the speculative-cascade baseline).

Each yields a ``BlockResult``; the decode loop (``loop.py``) runs the passes for every row at once, commits the
results and records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from viasd_hf.config import ViaSDConfig
from viasd_hf.engine.accept import (
    CascadeSet,
    Draft,
    GreedyTarget,
    Lenience,
    SampledTarget,
    Target,
    Verdict,
    accept_prefix,
)
from viasd_hf.engine.decisions import Decision, confidence, decide
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.verifier import TierLogits


@dataclass
class SlimCheck:
    """A slim pass next to the full pass that followed it in the same block: the slim tier's agreement, for free.

    The first ``rows`` rows of both views were scored after the same tokens (all of them unless a
    lossless repair changed the draft the full model saw).
    """

    slim: TierLogits
    full: TierLogits
    rows: int

    def agrees(self, view: TierLogits | None = None) -> list[bool]:
        """Whether ``view`` (the slim pass unless given) has the full model's top token, row by row."""
        rows = (view if view is not None else self.slim).scores[: self.rows].argmax(-1)
        return (rows == self.full.scores[: self.rows].argmax(-1)).tolist()


@dataclass
class BlockResult:
    """What one block commits and what it cost, per tier.

    ``made_by`` names who produced each token (``drafter``, ``slim`` or ``full``); row ``i`` of ``rows``
    is the pass that chose token ``i``. ``judged`` drafts were walked by the tier that decided the
    block (``decided_by``) and ``kept`` of them accepted.
    """

    tokens: list[int]
    made_by: list[str]
    rows: TierLogits
    judged: int
    kept: int
    decided_by: str
    escalated: bool = False
    regenerated: bool = False  # the slim verifier committed (tiered) or proposed (lossless) a token of its own
    repair_gain: int = 0  # lossless: tokens the slim tier's repair added to the block (−1, 0 or 1)
    passes: dict[str, int] = field(default_factory=lambda: {"slim": 0, "full": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"slim": 0.0, "full": 0.0})
    check: SlimCheck | None = None  # a slim pass the full model followed on the same block
    slim_would_commit: int | None = None  # a shadow probe: tokens the slim tier would have committed (0: escalated)
    second_choice_kept: bool = False  # the full model's token was the drafter's second choice, verified beside the draft


@dataclass
class VerificationRules:
    """How a pass's scores become the target each tier verifies against: greedy (``rng`` is ``None``) or exact
    sampling; plain, or a speculative cascade (``config.knobs.cascade_lenience``); the slim tier's thresholds."""

    config: ViaSDConfig
    rng: RandomStream | None

    @property
    def sampling(self) -> bool:
        return self.rng is not None

    def full(self, view: TierLogits) -> Target:
        """The full model's target: its own choice, or within ``1 − α`` of it in a speculative cascade."""
        lenience = self.config.knobs.cascade_lenience
        if self.rng is None:
            if lenience is None:
                return GreedyTarget(view.scores)
            return GreedyTarget(view.scores, lambda i, token: confidence(view.unscaled[i], token, "ratio") > 1 - lenience)
        cascade = None if lenience is None else CascadeSet(view.unscaled, 1 - lenience)
        return SampledTarget(view.probs, self.rng, cascade)

    def slim(self, view: TierLogits) -> Target:
        """The slim verifier's target: a draft it is confident in (``tau_accept``) is kept; greedy decoding
        regenerates the rest with its argmax, sampling rejection-samples against the cascade target π."""
        if self.rng is None:
            return GreedyTarget(view.scores, lambda i, token: decide(view.unscaled[i], token, self.config) is Decision.ACCEPT)
        return SampledTarget(view.probs, self.rng, CascadeSet(view.unscaled, self.config.knobs.tau_accept))

    def slim_escalates(self, view: TierLogits) -> Lenience | None:
        """Drafts the slim verifier hands to the full model (confidence at most ``tau_escalate``).

        Never in sampled lossless decoding: there the full model verifies every token the slim tier
        passes on against the distribution it follows, and a stop that depends on the token would
        bias that distribution.
        """
        if self.sampling and self.config.mode == "lossless":
            return None
        return lambda i, token: decide(view.unscaled[i], token, self.config) is Decision.ESCALATE


def slim_walk(rules: VerificationRules, view: TierLogits, draft: Draft) -> Verdict:
    """The slim tier's verdict on ``draft`` in tiered mode."""
    return accept_prefix(draft, rules.slim(view), rules.slim_escalates(view))


def after_slim_walk(block: BlockResult, view: TierLogits, draft: Draft, verdict: Verdict, shadow: bool) -> BlockResult:
    """The full model's ``block`` on a ``draft`` the slim tier walked first (``view``, ``verdict``), recorded as an
    escalated block or, for a ``shadow`` probe, with what the slim tier would have committed. A row escalates with
    the batch: the full pass one row's escalation asked for decides every row."""
    if shadow:
        would_commit = 0 if verdict.escalated else verdict.kept + 1
        return _after_slim_pass(block, view, draft, draft, slim_would_commit=would_commit)
    return _after_slim_pass(block, view, draft, draft, escalated=True)


@dataclass
class SlimRepair:
    """The slim verifier's walk over a draft in lossless mode, and the draft the full model verifies (``verified``):
    the drafts up to the first one the slim tier would not keep, then its own token in that one's place."""

    verified: Draft
    verdict: Verdict
    repaired: bool = False


def slim_repair(rules: VerificationRules, view: TierLogits, draft: Draft) -> SlimRepair:
    """Lossless mode's slim tier on one draft (``view``: its pass over it): replace the first draft it would not
    keep by its own token, dropping the drafts after it."""
    slim_target = rules.slim(view)
    verdict = accept_prefix(draft, slim_target, rules.slim_escalates(view))
    repaired = not verdict.escalated and verdict.kept < len(draft.tokens)
    tokens = draft.tokens[: verdict.kept] + [verdict.token] if repaired else list(draft.tokens)
    proposals = slim_target.followed if rules.sampling else draft.probs[: len(tokens)]
    return SlimRepair(Draft(tokens, proposals), verdict, repaired)


def after_repair(block: BlockResult, view: TierLogits, draft: Draft, repair: SlimRepair) -> BlockResult:
    """The full model's ``block`` over ``repair.verified``, with the slim pass (``view``) over ``draft`` and its
    repair counted in: the repaired token is credited to the slim tier where it added a token."""
    kept = repair.verdict.kept
    gain = repair_credit(kept, draft.tokens[kept], block.tokens) if repair.repaired else 0
    if gain > 0:
        block.made_by[kept] = "slim"
    return _after_slim_pass(block, view, draft, repair.verified, regenerated=repair.repaired, repair_gain=gain)


def repair_credit(position: int, replaced: int, committed: list[int]) -> int:
    """Tokens a slim repair at ``position`` added to a verified block, as far as the block shows.

    +1 when the full model kept the repaired token (it had chosen otherwise than the draft there,
    so the block gained that token); −1 when the full model's own token is the draft the slim tier
    threw away (it would have kept it, and perhaps more); 0 otherwise.
    """
    if len(committed) <= position:
        return 0
    if len(committed) > position + 1:
        return 1
    return -1 if committed[position] == replaced else 0


def decided(draft: Draft, verdict: Verdict, view: TierLogits, tier: str) -> BlockResult:
    """The drafts ``verdict`` kept and then ``tier``'s own token, from ``tier``'s one pass (``view``); the only pass
    of the block until ``_after_slim_pass`` counts in a slim pass before it."""
    other = "full" if tier == "slim" else "slim"
    return BlockResult(
        tokens=draft.tokens[: verdict.kept] + [verdict.token],
        made_by=["drafter"] * verdict.kept + [tier],
        rows=view,
        judged=len(draft.tokens),
        kept=verdict.kept,
        decided_by=tier,
        regenerated=tier == "slim",
        passes={tier: 1, other: 0},
        seconds={tier: view.seconds, other: 0.0},
    )


def _after_slim_pass(
    block: BlockResult,
    view: TierLogits,
    scored: Draft,
    verified: Draft,
    **changes: object,
) -> BlockResult:
    """``block`` (decided by the full model, which verified ``verified``) with the slim pass over ``scored`` that
    preceded it counted in, and the two passes side by side."""
    shared = next((i for i, (a, b) in enumerate(zip(scored.tokens, verified.tokens)) if a != b), None)
    rows = min(len(scored.tokens), len(verified.tokens)) if shared is None else shared
    check = SlimCheck(view, block.rows, rows + 1)
    return replace(
        block,
        passes=block.passes | {"slim": 1},
        seconds=block.seconds | {"slim": view.seconds},
        check=check,
        **changes,
    )
