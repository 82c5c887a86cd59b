"""How long to draft: keep drafting while one more draft token is worth its cost.

The model. A block that drafts ``k`` tokens costs

    C(k) = k·d + a + b·(k + 1)

seconds — ``k`` drafter passes of ``d`` seconds, and a verifying pass of ``a`` seconds plus ``b`` per
token it is fed — and commits, in expectation,

    E(k) = 1 + P₁ + … + P_k

tokens, where ``P_j`` is the probability that the first ``j`` drafts are all kept (the verifier
always adds a token of its own). ``P_j = a(c₁)·…·a(c_j)``, with ``a(c)`` the probability that a draft
the drafter gave confidence ``c`` is kept once the drafts before it were: the drafter's own
confidence, calibrated online on what the verifiers really kept (``AcceptanceModel``).

Drafting one more token raises the block's throughput ``E/C`` iff ``P_{k+1}·C(k) > E(k)·(d + b)``.
``P_{k+1}`` is only known after the pass that drafts that token, so it is estimated as
``P_k·a(c_k)``: how sure the drafter will be of its next token is best foretold by how sure it was
of its last. (The mean acceptance measured at position ``k + 1`` foretells it worse, and feeds on
itself: a position seldom reached keeps a pessimistic prior, so it stays seldom reached. Replayed
on recorded Spec-Bench, HumanEval and XSum traces, the last confidence drafts longer and decodes
faster: ``bench/studies/draft_stop_rule``.) So a cheap drafter drafts longer, a confident one too, and a draft the drafter is
unsure of ends the block (HF's confidence stop, with the threshold derived instead of fixed at
0.4). A batch verifies every row's draft in one pass as wide as the longest, so it sums both sides
over its rows and drafts one more column only if the rows still drafting gain what the column
costs them all (``keep_drafting_rows``). The first token is always drafted, so the calibration
keeps learning; whether a block drafts at all is measured, not planned
(``speculation_switch.SpeculationSwitch``: where costs are measured, plain decoding whenever it is faster).

Where the costs come from (``PassCosts``): measured on the fly (``MeasuredCosts``: ratios of passes measured moments
apart, whose medians a burst of load cannot move for long, starting from the static guess), or, where timings must not
change the output (``ViaSDConfig.reproducible``), from the weights each pass reads
(``StaticCosts``): decoding one token is memory-bound, so a pass costs about the bytes it reads.
Where costs are measured, the planner (costs and calibration) is remembered across calls on the
model (``memory.draft_planner``), so a short call does not start uncalibrated.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol

from torch import nn

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.faded import FadedMean
from viasd_hf.control.speculation_switch import PAIR_DISTANCE, SpeculationSwitch
from viasd_hf.control.tier_controller import measures_wall_clock
from viasd_hf.masks.architectures import decoder_layers
from viasd_hf.masks.routing_mask import RoutingMask

PER_TOKEN_SHARE = 0.03  # b / a before it is measured: a pass's cost grows little with the tokens it is fed on CPU


# Upper edges of the confidence bins. Above 0.9 the scale is logarithmic in 1 − c: on code a drafter is often
# 0.999 sure and right, and one bin for [0.9, 1] would price such a draft like a 0.9 one and end blocks early.
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 0.999)


@dataclass
class AcceptanceModel:
    """``a(c)``: the chance a draft of drafter confidence ``c`` is kept, given the drafts before it were.

    Confidences are binned (``CONFIDENCE_EDGES``); each bin's estimate starts at the middle of the
    bin (a calibrated drafter) and moves to what the verifiers kept.
    """

    edges: tuple[float, ...] = CONFIDENCE_EDGES
    decay: float = 0.98
    prior_weight: float = 2.0
    by_confidence: list[FadedMean] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_confidence = self.by_confidence or [FadedMean() for _ in range(len(self.edges) + 1)]

    def _bin(self, confidence: float) -> int:
        return bisect.bisect_right(self.edges, confidence)

    def kept(self, confidence: float) -> float:
        index = self._bin(confidence)
        low, high = ((0.0, *self.edges)[index], (*self.edges, 1.0)[index])
        return self.by_confidence[index].mean((low + high) / 2, self.prior_weight)

    def observe(self, confidences: list[float], judged: int, kept: int) -> None:
        """A verified block: the first ``kept`` of ``judged`` drafts were kept. Drafts after the first
        rejected one were never judged on their own, so they teach nothing."""
        for position, confidence in enumerate(confidences[: min(judged, kept + 1)]):
            self.observe_one(confidence, position < kept)

    def observe_one(self, confidence: float, kept: bool) -> None:
        """One draft of ``confidence``, kept or not."""
        self.by_confidence[self._bin(confidence)].observe(float(kept), self.decay)


class PassCosts(Protocol):
    """Seconds (or any common unit) of a drafter pass, and of a verifying pass: ``base + per_token · tokens``."""

    def drafter_pass(self) -> float: ...

    def verify_base(self) -> float: ...

    def verify_per_token(self) -> float: ...


@dataclass
class StaticCosts:
    """Costs in units of a one-token target pass, from the bytes each pass reads; the same on every run."""

    drafter: float
    per_token: float = PER_TOKEN_SHARE

    def drafter_pass(self) -> float:
        return self.drafter

    def verify_base(self) -> float:
        return 1.0

    def verify_per_token(self) -> float:
        return self.per_token

    @classmethod
    def for_drafter(cls, target: nn.Module, drafter_model: nn.Module | None, drafter_mask: RoutingMask | None) -> StaticCosts:
        """A separate drafter reads its own weights; the self-drafter reads the target's minus the layers it skips."""
        target_bytes = weight_bytes(target)
        if drafter_mask is not None:
            layers = decoder_layers(target)
            skipped = sum(weight_bytes(layers[index]) for index in drafter_mask.skipped_layers)
            return cls(drafter=(target_bytes - skipped) / target_bytes)
        return cls(drafter=weight_bytes(drafter_model) / target_bytes if drafter_model is not None else 0.0)


def weight_bytes(module: nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())


@dataclass
class MeasuredCosts:
    """The costs measured on the call's own passes, as ratios a burst of load cannot fake for long, in units of a
    one-token verifying pass ``a + b``, of which ``s = b / (a + b)`` is what its token adds:

    - ``s`` from pairs of verifying passes at most ``PAIR_DISTANCE`` blocks apart that were fed different numbers of
      tokens, ``t_i / t_j = (1 − s + s·w_i) / (1 − s + s·w_j)``: plain blocks feed one token, speculative ones their
      drafts and one more;
    - ``d`` from each block's drafter passes over the verifying pass of the same block, moments later.

    Each is the median of the latest ``kept``: a burst of load slows both passes of a pair, whose ratio then stands,
    or spoils a few ratios, which the median passes over; a lasting change of load slows every pass and changes no
    ratio. The planner's rule compares costs with costs, so their unit does not matter. Before anything is measured,
    the static guess (``StaticCosts``).
    """

    static: StaticCosts
    kept: int = 15
    shares: deque[float] = field(init=False)  # s, from nearby pairs of verifying passes
    drafter_ratios: deque[tuple[float, int]] = field(init=False)  # (drafter pass / that block's verifying pass, tokens)
    verifying: deque[tuple[int, int, float]] = field(init=False)  # the latest passes: (block, tokens fed, seconds)
    drafting: float | None = None  # seconds per drafter pass of the block under way, until its verifying pass
    block: int = 0
    share: float | None = None  # the medians, taken once a block (the planner asks for every drafted column)
    drafter: float | None = None

    def __post_init__(self) -> None:
        self.shares, self.drafter_ratios = deque(maxlen=self.kept), deque(maxlen=self.kept)
        self.verifying = deque(maxlen=PAIR_DISTANCE)

    def observe_drafting(self, seconds: float, passes: int) -> None:
        """The block under way drafted with ``passes`` drafter passes in ``seconds``."""
        self.drafting = seconds / passes if passes and seconds > 0 else None

    def observe_verifying(self, seconds: float, tokens: int) -> None:
        """The block's verifying pass (a plain block's too) was fed ``tokens`` tokens and took ``seconds``."""
        if seconds <= 0:
            return
        if self.drafting is not None and tokens > 1:  # one token fed: a plain block, which drafted nothing
            self.drafter_ratios.append((self.drafting / seconds, tokens))
        self.drafting = None
        for block, fed, other in self.verifying:
            if fed != tokens and self.block - block <= PAIR_DISTANCE:
                self.shares.append(_per_token_share((tokens, seconds), (fed, other)))
        self.verifying.append((self.block, tokens, seconds))
        self.block += 1
        self.share = median(self.shares) if self.shares else None
        share = self._share()
        self.drafter = median(ratio * (1 - share + share * fed) for ratio, fed in self.drafter_ratios) \
            if self.drafter_ratios else None

    def _share(self) -> float:
        if self.share is not None:
            return self.share
        return self.static.per_token / (self.static.verify_base() + self.static.per_token)

    def verify_base(self) -> float:
        return 1 - self._share()

    def verify_per_token(self) -> float:
        return self._share()

    def drafter_pass(self) -> float:
        return self.drafter if self.drafter is not None else self.static.drafter

    def verify_ratio(self, tokens: int = 6) -> float | None:
        """What a verifying pass over ``tokens`` tokens costs relative to a one-token pass, once measured."""
        return 1 + self._share() * (tokens - 1) if self.share is not None else None


def _per_token_share(one: tuple[int, float], other: tuple[int, float]) -> float:
    """``s`` from two verifying passes, each (tokens fed, seconds), solving ``t₁ / t₂ = (1 − s + s·w₁) / (1 − s + s·w₂)``
    for the wider one's ``w₁``; within ``[0, 1]``, where a burst on one of the two can put the solution anywhere
    (the median sorts it out)."""
    (w1, t1), (w2, t2) = sorted((one, other), reverse=True)
    ratio = t1 / t2
    return min(max((ratio - 1) / (w1 - 1 - ratio * (w2 - 1)), 0.0), 1.0) if w1 - 1 > ratio * (w2 - 1) else 1.0


@dataclass
class DraftPlanner:
    """Decides, after each drafted token, whether to draft another (see the module docstring), and, where costs are
    measured, whether a block drafts at all (``switch``: plain decoding when speculation does not pay)."""

    costs: StaticCosts | MeasuredCosts
    longest: int
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    switch: SpeculationSwitch | None = None
    # where the full model rejects a draft, the chance its token is the drafter's second choice, by that choice's
    # probability once the first is ruled out (``second_choices_worth``)
    second: AcceptanceModel = field(default_factory=AcceptanceModel)

    def keep_drafting_rows(self, confidences: list[list[float]], drafting: list[bool]) -> bool:
        """Whether a batch drafts one more column for the rows still ``drafting`` (``confidences``: each row's).

        A batch verifies every row's draft in one pass as wide as the longest, so one more column costs
        the whole block ``d + b`` while only the rows still drafting gain: it is worth it iff
        ``Σ P_{k+1}·C(k) > Σ E(k)·(d + b)``, summed over the rows (the rows that stopped count in the
        block's tokens, not in the gain). A single sequence is a batch of one."""
        drafted = max(len(row) for row in confidences)
        if drafted >= self.longest:
            return False
        if drafted == 0:
            return True
        expected, next_kept = 0.0, 0.0
        for row, going_on in zip(confidences, drafting):
            row_expected, row_next = self._expectation(row)
            expected += row_expected
            next_kept += row_next if going_on else 0.0
        draft, base, per_token = self.costs.drafter_pass(), self.costs.verify_base(), self.costs.verify_per_token()
        block_cost = drafted * draft + base + per_token * (drafted + 1)
        return next_kept * block_cost > expected * (draft + per_token)

    def second_choices_worth(self, confidences: list[float], seconds: list[float | None]) -> list[bool]:
        """Which of a draft's second choices to verify beside it (``seconds``: the drafter's probability of its second
        choice at each position, ``None`` where it has none; ``engine.batch.second_choices``).

        The second choice at position ``j`` is kept where the drafts before it were, draft ``j`` was not, and the full
        model's token there is that choice: ``P_{j−1}·(1 − a(c_j))·a₂(q_j / (1 − c_j))``, where ``a₂`` is the chance
        the full model's token is the second choice given the drafter's probability of it once its first is ruled
        out, calibrated on every rejected draft (``observe_second``: the full model's token says so whether or not
        the choice was fed). It adds that token and the full model's next, for one column more of the verifying pass:
        worth it iff that chance times ``C(k)`` exceeds ``E(k)·b``. Where a column costs little (a CPU or GPU pass
        over a few tokens costs about what one token's does) most are worth it; where verifying costs about a pass
        per token (bf16 emulated on a CPU without it), few are."""
        expected, _ = self._expectation(confidences)
        drafted, per_token = len(confidences), self.costs.verify_per_token()
        block_cost = drafted * self.costs.drafter_pass() + self.costs.verify_base() + per_token * (drafted + 1)
        worth, all_kept = [], 1.0
        for confidence, second in zip(confidences, seconds):
            kept = self.acceptance.kept(confidence)
            chance = 0.0 if second is None else all_kept * (1 - kept) * self.second.kept(_ruled_out(second, confidence))
            worth.append(chance * block_cost > expected * per_token)
            all_kept *= kept
        return worth

    def observe_second(self, confidence: float, second: float, kept: bool) -> None:
        """The full model rejected a draft of ``confidence``; its token was (``kept``) or was not the drafter's second
        choice there, of probability ``second``."""
        self.second.observe_one(_ruled_out(second, confidence), kept)

    def _expectation(self, confidences: list[float]) -> tuple[float, float]:
        """``E(k)`` for a draft of these confidences and the estimate of ``P_{k+1}``."""
        all_kept, expected = 1.0, 1.0
        for confidence in confidences:
            all_kept *= self.acceptance.kept(confidence)
            expected += all_kept
        next_kept = all_kept * self.acceptance.kept(confidences[-1]) if confidences else 1.0
        return expected, next_kept

    def observe(self, confidences: list[float], judged: int, kept: int) -> None:
        """What the verifiers kept (``kept`` of the ``judged`` first) of a draft a model drew with ``confidences``."""
        self.acceptance.observe(confidences, judged, kept)


def _ruled_out(second: float, first: float) -> float:
    """The drafter's probability of its second choice once its first is ruled out."""
    return min(second / max(1 - first, 1e-9), 1.0)


LONGEST_TWO_TIER_DRAFT = 32  # drafts per block when only the full model verifies: a bound, the stop rule decides


def new_draft_planner(costs: StaticCosts, config: ViaSDConfig, do_sample: bool) -> DraftPlanner:
    """Draft lengths planned from measured costs (starting from ``costs``, with the switch to plain decoding) where
    timings may steer the output, else from ``costs``, the weight sizes."""
    switch = None
    if measures_wall_clock(config.reproducible, config.mode == "lossless", do_sample):
        costs, switch = MeasuredCosts(costs), SpeculationSwitch()
    return DraftPlanner(costs, longest=max(3 * config.knobs.num_draft_tokens, LONGEST_TWO_TIER_DRAFT), switch=switch)


def longest_draft(config: ViaSDConfig, planner: DraftPlanner | None, slim_may_run: bool) -> int:
    """A block's bound on its drafts: ``num_draft_tokens`` without a planner; with one, short enough for the slim
    tier where it may verify the block (``3 · num_draft_tokens`` and below ``max_slim_backlog``), else the planner's."""
    if planner is None:
        return config.knobs.num_draft_tokens
    if slim_may_run:
        return min(3 * config.knobs.num_draft_tokens, config.knobs.max_slim_backlog - 1)
    return planner.longest
