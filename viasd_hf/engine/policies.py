"""Block policies: what the tiers do with one draft, as in the paper's algorithm.

- ``two_tier``: standard speculative decoding; the full model keeps the drafts it accepts and adds
  its own token. With ``cascade_lenience`` it is the speculative-cascade baseline.
- ``tiered``: the slim verifier walks the draft and commits on its own authority, unless it is
  unsure of a draft: then the block escalates to ``two_tier``.
- ``lossless``: the slim verifier may replace one draft (dropping those after it), then the full
  model verifies the block; the output is the full model's own.
- ``shadow_tiered``: a probe of the slim tier that commits nothing of its own: the slim verifier
  walks the draft as ``tiered`` would, then the full model decides the block as ``two_tier``.

Each returns a ``BlockResult``; the decode loop (``loop.py``) commits it and records it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

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
from viasd_hf.engine.state import DecodingState
from viasd_hf.engine.verifier import TierLogits, Verifier


@dataclass
class SlimCheck:
    """A slim pass next to the full pass that followed it in the same block: the slim tier's agreement, for free.

    The first ``rows`` rows of both views were scored after the same tokens (all of them unless a
    lossless repair changed the draft the full model saw). ``probe`` is another mask's pass over
    the slim pass's draft, when the mask chooser asked for one (``mask_chooser``).
    """

    slim: TierLogits
    full: TierLogits
    rows: int
    probe: TierLogits | None = None

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
    slim_would_commit: int | None = None  # shadow_tiered: tokens the slim tier would have committed (0: escalated)
    runner_up_taken: bool = False  # the full model chose the drafter's runner-up: one token more (``branching``)


@dataclass
class VerificationRules:
    """How a pass's scores become the target each tier verifies against: greedy (``rng`` is ``None``) or exact
    sampling; plain, or a speculative cascade (``config.cascade_lenience``); the slim tier's thresholds."""

    config: ViaSDConfig
    rng: RandomStream | None

    @property
    def sampling(self) -> bool:
        return self.rng is not None

    def full(self, view: TierLogits) -> Target:
        """The full model's target: its own choice, or within ``1 − α`` of it in a speculative cascade."""
        lenience = self.config.cascade_lenience
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
        return SampledTarget(view.probs, self.rng, CascadeSet(view.unscaled, self.config.tau_accept))

    def slim_escalates(self, view: TierLogits) -> Lenience | None:
        """Drafts the slim verifier hands to the full model (confidence at most ``tau_escalate``).

        Never in sampled lossless decoding: there the full model verifies every token the slim tier
        passes on against the distribution it follows, and a stop that depends on the token would
        bias that distribution.
        """
        if self.sampling and self.config.mode == "lossless":
            return None
        return lambda i, token: decide(view.unscaled[i], token, self.config) is Decision.ESCALATE


@dataclass
class Tiers:
    """The two verifying tiers of one call and the rules they verify by.

    ``probe`` (another mask, set by the mask chooser for a block) scores the slim tier's draft too,
    but only when the full model is about to score it: measuring costs one routed pass and changes
    no token.
    """

    full: Verifier
    slim: Verifier | None
    rules: VerificationRules
    probe: Verifier | None = None

    def probed(self, state: DecodingState, draft: Draft) -> TierLogits | None:
        """The probed mask's pass over ``draft``; call it only right before the full pass that will score the draft."""
        return self.probe.score(state, draft.tokens) if self.probe is not None else None


Policy = Callable[[Tiers, DecodingState, Draft], BlockResult]


def two_tier(tiers: Tiers, state: DecodingState, draft: Draft) -> BlockResult:
    """Standard verification: keep the drafts the full model accepts, then add the full model's own token.

    With the drafter's runner-up verified beside the draft (``branching``): where the full model's own
    token is that runner-up, the block goes on with it and the full model's token after it."""
    view = tiers.full.score(state, draft.tokens, draft.runner_up)
    verdict = accept_prefix(draft, tiers.rules.full(view))
    if takes_runner_up(draft, verdict):
        state.target_cache.keep_leaf(state.length + verdict.kept, state.length + len(draft.tokens))
        return _decided_on_leaf(draft, verdict, view, tiers.rules.full(view.leaf).bonus(0))
    state.target_cache.keep(state.length + verdict.kept)
    return decided(draft, verdict, view, "full")


def takes_runner_up(draft: Draft, verdict: Verdict) -> bool:
    """Whether the full model rejected the draft exactly where the runner-up stands, in its favour."""
    runner_up = draft.runner_up
    return runner_up is not None and verdict.kept == runner_up.position and verdict.token == runner_up.token


def tiered(tiers: Tiers, state: DecodingState, draft: Draft) -> BlockResult:
    """The paper's block: the slim tier commits on its own authority unless it escalates a draft."""
    view = tiers.slim.score(state, draft.tokens)
    verdict = slim_walk(tiers.rules, view, draft)
    if verdict is None:
        return _after_slim_pass(two_tier(tiers, state, draft), view, escalated=True)
    if verdict.escalated:
        probe = tiers.probed(state, draft)
        return _after_slim_pass(two_tier(tiers, state, draft), view, draft, draft, probe, escalated=True)
    return decided(draft, verdict, view, "slim")


def shadow_tiered(tiers: Tiers, state: DecodingState, draft: Draft) -> BlockResult:
    """The slim tier's walk as ``tiered`` would take it, but the full model decides the block as ``two_tier``.

    What the slim tier would have committed prices a slim block (``tier_controller.TierController`` probes
    the slim tier this way while it is off) without a token of the output being the slim tier's.
    """
    view = tiers.slim.score(state, draft.tokens)
    verdict = slim_walk(tiers.rules, view, draft)
    if verdict is None:  # as in ``tiered``: this block would have escalated
        return _after_slim_pass(two_tier(tiers, state, draft), view, slim_would_commit=0)
    probe = tiers.probed(state, draft)
    block = two_tier(tiers, state, draft)
    would_commit = 0 if verdict.escalated else verdict.kept + 1
    return _after_slim_pass(block, view, draft, draft, probe, slim_would_commit=would_commit)


def slim_walk(rules: VerificationRules, view: TierLogits, draft: Draft) -> Verdict | None:
    """The slim tier's verdict on ``draft`` in tiered mode; ``None`` when a draft vocabulary the processors rule
    out leaves it nothing to vouch with (the block escalates, and there is no choice to compare)."""
    if not view.every_row_has_a_choice:
        return None
    return accept_prefix(draft, rules.slim(view), rules.slim_escalates(view))


def after_slim_walk(block: BlockResult, view: TierLogits, draft: Draft, verdict: Verdict | None,
                    shadow: bool) -> BlockResult:
    """The full model's ``block`` on a ``draft`` the slim tier walked first (``view``, ``verdict``), recorded as
    ``tiered`` records an escalated block or, for a ``shadow`` probe, as ``shadow_tiered`` does. A batch's row
    escalates with the batch: the full pass one row's escalation asked for decides every row."""
    if verdict is None:
        return _after_slim_pass(block, view, **({"slim_would_commit": 0} if shadow else {"escalated": True}))
    if shadow:
        would_commit = 0 if verdict.escalated else verdict.kept + 1
        return _after_slim_pass(block, view, draft, draft, slim_would_commit=would_commit)
    return _after_slim_pass(block, view, draft, draft, escalated=True)


def lossless(tiers: Tiers, state: DecodingState, draft: Draft) -> BlockResult:
    """The slim tier may replace one draft (dropping those after it); the full model verifies the block.

    Sampling hands the full model, as each slim-checked token's proposal, the cascade target π it
    now follows, repaired or not.
    """
    view = tiers.slim.score(state, draft.tokens)
    repair = slim_repair(tiers.rules, view, draft)
    if repair.verdict is None:  # a draft vocabulary the processors rule out: no repair to offer
        return after_repair(two_tier(tiers, state, draft), view, draft, repair)
    probe = tiers.probed(state, draft)
    return after_repair(two_tier(tiers, state, repair.verified), view, draft, repair, probe)


@dataclass
class SlimRepair:
    """The slim verifier's walk over a draft in lossless mode, and the draft the full model verifies (``verified``):
    the drafts up to the first one the slim tier would not keep, then its own token in that one's place."""

    verified: Draft
    verdict: Verdict | None  # None: a draft vocabulary left the slim tier no choice to offer, nothing was walked
    repaired: bool = False


def slim_repair(rules: VerificationRules, view: TierLogits, draft: Draft) -> SlimRepair:
    """Lossless mode's slim tier on one draft (``view``: its pass over it): replace the first draft it would not
    keep by its own token, dropping the drafts after it."""
    if not view.every_row_has_a_choice:
        return SlimRepair(draft, None)
    slim_target = rules.slim(view)
    verdict = accept_prefix(draft, slim_target, rules.slim_escalates(view))
    repaired = not verdict.escalated and verdict.kept < len(draft.tokens)
    tokens = draft.tokens[: verdict.kept] + [verdict.token] if repaired else list(draft.tokens)
    proposals = slim_target.followed if rules.sampling else draft.probs[: len(tokens)]
    return SlimRepair(Draft(tokens, proposals), verdict, repaired)


def after_repair(
    block: BlockResult, view: TierLogits, draft: Draft, repair: SlimRepair, probe: TierLogits | None = None
) -> BlockResult:
    """The full model's ``block`` over ``repair.verified``, with the slim pass (``view``) over ``draft`` and its
    repair counted in: the repaired token is credited to the slim tier where it added a token."""
    if repair.verdict is None:
        return _after_slim_pass(block, view)
    kept = repair.verdict.kept
    gain = repair_credit(kept, draft.tokens[kept], block.tokens) if repair.repaired else 0
    if gain > 0:
        block.made_by[kept] = "slim"
    return _after_slim_pass(block, view, draft, repair.verified, probe, regenerated=repair.repaired, repair_gain=gain)


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


def _decided_on_leaf(draft: Draft, verdict: Verdict, view: TierLogits, bonus: int) -> BlockResult:
    """The drafts kept before the runner-up, the runner-up (the full model's own choice there) and the full
    model's token after it; row ``i`` of ``rows`` still chose token ``i``."""
    block = decided(draft, verdict, view, "full")
    rows = TierLogits(torch.cat([view.logits[: verdict.kept + 1], view.leaf.logits]),
                      torch.cat([view.scores[: verdict.kept + 1], view.leaf.scores]), view.seconds, view.fed)
    return replace(block, tokens=block.tokens + [bonus], made_by=block.made_by[:-1] + ["drafter", "full"], rows=rows,
                   runner_up_taken=True)


def _after_slim_pass(
    block: BlockResult,
    view: TierLogits,
    scored: Draft | None = None,
    verified: Draft | None = None,
    probe: TierLogits | None = None,
    **changes: object,
) -> BlockResult:
    """``block`` (decided by the full model, which verified ``verified``) with the slim pass over ``scored`` that
    preceded it counted in, and the two passes side by side (not when the slim pass had no choice to compare)."""
    check = None
    if scored is not None and verified is not None:
        shared = next((i for i, (a, b) in enumerate(zip(scored.tokens, verified.tokens)) if a != b), None)
        rows = min(len(scored.tokens), len(verified.tokens)) if shared is None else shared
        check = SlimCheck(view, block.rows, rows + 1, probe)
    return replace(
        block,
        passes=block.passes | {"slim": 1},
        seconds=block.seconds | {"slim": view.seconds},
        check=check,
        **changes,
    )
