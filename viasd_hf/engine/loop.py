"""The VIA-SD decode loop: draft → verify with a block policy → commit, until a stopping criterion.

One block, as in the paper:

1. the drafter proposes up to γ tokens (``Drafter.draft``);
2. the block policy (``policies.py``) verifies them: ``tiered`` lets the slim verifier accept,
   regenerate or escalate them; ``lossless`` lets it repair one before the full model verifies;
   ``two_tier`` is plain speculative decoding, used when the slim tier is off;
3. the tokens are committed one at a time, honouring stopping criteria and streamers as
   ``generate`` does, and the block is recorded (``ViaSDStats.record_block``).

Whether a block drafts at all is the speculation switch's choice (``speculation_switch.py``): where speculation
does not pay on this machine, blocks decode one token plainly, as ``generate`` does, and
speculation is probed now and then. Whether the slim tier runs for a block is the controller's choice (``tier_controller.py``), unless the
tokens the slim tier committed without the full model (its backlog, docs/design.md, "The KV cache") would exceed
``max_slim_backlog``: then the full model catches up first. With a ``MaskSet``, which of its masks
the slim tier runs is the mask chooser's choice (``mask_chooser.py``).
"""

from __future__ import annotations

import time
import warnings

from torch import nn
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import DraftPlanner, MeasuredCosts, StaticCosts, static_costs
from viasd_hf.control.mask_chooser import MaskChoice
from viasd_hf.control.memory import draft_planner, mask_chooser, planner_key, tier_choice, tier_memory
from viasd_hf.control.speculation_switch import DrafterRead, SpeculationSwitch, fallback_advice
from viasd_hf.control.tier_controller import BlockCost, measures_wall_clock
from viasd_hf.drafters import Drafter, SelfDrafter, model_drafter_of
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.attention import fastest_attention
from viasd_hf.engine.branching import can_branch, runner_up
from viasd_hf.engine.policies import (
    BlockResult,
    Policy,
    Tiers,
    VerificationRules,
    lossless,
    shadow_tiered,
    tiered,
    two_tier,
)
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.state import DecodingState
from viasd_hf.engine.stats import ViaSDStats
from viasd_hf.engine.verifier import TierLogits, Verifier
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.vocabulary.head import SubsetHead

LONGEST_TWO_TIER_DRAFT = 32  # drafts per block when only the full model verifies: a bound, the stop rule decides


class ViaSDDecoder:
    """One generate call's worth of VIA-SD; ``run`` returns the committed sequence."""

    def __init__(
        self,
        model: nn.Module,
        drafter: Drafter,
        config: ViaSDConfig,
        slim_mask: RoutingMask | MaskSet | None,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        max_length: int,
        streamer: BaseStreamer | None = None,
        keep_scores: bool = False,
        keep_logits: bool = False,
        check_invariants: bool = False,
        do_sample: bool = False,
        slim_head: SubsetHead | None = None,
    ) -> None:
        self.model = model
        self.drafter = drafter
        self.config = config
        self.stopping_criteria = stopping_criteria
        self.max_length = max_length
        self.streamer = streamer
        self.keep_scores = keep_scores
        self.keep_logits = keep_logits
        self.check_invariants = check_invariants
        self.stats = ViaSDStats()
        self.rng = RandomStream.from_global_seed() if do_sample else None  # every random draw of this call
        self.chooser = None
        drafter_key = drafter_identity(drafter)
        if isinstance(slim_mask, MaskSet):
            self.chooser = MaskChoice.for_set(slim_mask, model, logits_processor, slim_head,
                                              mask_chooser(model, slim_mask, drafter_key, config, do_sample))
            drafter_key += (tuple(tuple(mask.kept_layers) for mask in slim_mask.masks.values()),)  # its own measurements
            slim_mask = slim_mask.default_mask
        slim = Verifier(model, slim_mask, logits_processor, slim_head) if slim_mask is not None else None
        self.tiers = Tiers(Verifier(model, None, logits_processor), slim, VerificationRules(config, self.rng))
        self.slim_policy: Policy = lossless if config.mode == "lossless" else tiered
        self.controller = None
        if config.adaptive and slim_mask is not None:
            self.controller = tier_choice(model, slim_mask, drafter_key, config, do_sample)
        self._first_switch = len(self.controller.switches) if self.controller is not None else 0
        self.steers_attention = steers_attention(config, do_sample)
        self.verifies_runner_up = config.runner_up and not do_sample  # and where the cache allows it (``run``)
        self.planner_key = planner_key(drafter_key, slim_mask, config, do_sample) if config.adaptive else None
        self.planner = None
        if config.adaptive:
            self.planner = draft_planner(model, self.planner_key,
                                         lambda: new_draft_planner(static_costs(model, drafter), config, do_sample))
        self.switch = self.planner.switch if self.planner is not None else None
        self._first_fallback_switch = len(self.switch.switches) if self.switch is not None else 0
        self.drafter_read = DrafterRead(self.switch)  # the drafter reads the prompt before its first draft
        self.finished = False

    def run(self, state: DecodingState) -> DecodingState:
        """Decode from ``state`` (the prompt, an empty cache) until a stopping criterion or the length limit.

        Where timings may steer the output, short-query attention runs the kernel measured fastest
        (``attention.fastest_attention``): drafting and verifying passes are nearly all short queries."""
        started = time.perf_counter()
        if self.streamer is not None:
            self.streamer.put(state.ids.cpu())
        self.verifies_runner_up &= can_branch(self.model, state.target_cache.cache, state.target_cache.padded)
        with fastest_attention(self.steers_attention):
            if self.prefill(state):
                self.open(state)
            while not self.finished:
                self.step(state)
        if self.streamer is not None:
            self.streamer.end()
        if self.controller is not None:
            self.stats.tier_switches = self.controller.switches[self._first_switch :]
            self.stats.slim_tier_verdict = self.controller.verdict()
        if self.chooser is not None:
            self.stats.mask_choice = self.chooser.report()
        if self.switch is not None:
            self.stats.speculation_switches = self.switch.switches[self._first_fallback_switch :]
            self.stats.speculation_verdict = self.drafter_read.verdict or self.switch.verdict()
        if self.planner_key is not None:
            tier_memory(self.model).remember_planner(self.planner_key, self.planner)
        self.stats.seconds["total"] = time.perf_counter() - started
        return state

    def prefill(self, state: DecodingState) -> bool:
        """The drafter processes the prompt. The full model processes it in the first block's pass where that block
        is plain two-tier (``open``); otherwise it prefills the prompt but its last token, which opens the first block.
        Returns whether the first block carries the prompt."""
        if self.speculates(state):
            self.prefill_drafter(state)
        if state.length <= 1:  # nothing before the token that opens the first block
            return False
        if self.first_block_is_two_tier():
            return True
        started = time.perf_counter()
        state.target_cache.run(self.model, state.ids[:, :-1], 0, keep=1)
        state.target_cache.keep(state.length - 1)
        seconds = time.perf_counter() - started
        self.stats.record_prefill(seconds)
        self.drafter_read.observe_prefill(seconds, state.length - 1)
        return False

    def prefill_drafter(self, state: DecodingState) -> float:
        """The drafter reads what it has not read, before its first draft: the prompt, or, where decoding started
        plainly, everything committed so far. Returns the seconds it took."""
        started = time.perf_counter()
        passes = self.drafter.prefill(state.ids)
        seconds = time.perf_counter() - started
        self.stats.record_draft(passes, seconds)
        self.drafter_read.observe_read(seconds, state.length - 1)
        return seconds

    def speculates(self, state: DecodingState) -> bool:
        """Whether the next block drafts (``speculation_switch.SpeculationSwitch``; always, where timings may not steer).

        While speculating, a drafter that has not read the context drafts only where its read is expected to pay
        (``DrafterRead.pays``), as a batch's does; a probe of speculation reads whatever it costs, its read counted in
        what the probe is expected to lose (``SpeculationSwitch.probe_loss``)."""
        if self.switch is None:
            return True
        if not self.switch.speculates():
            return False
        if self.drafter_read.done or not self.switch.speculating:
            return True
        return self.drafter_read.pays(state.length - 1, self.max_length - state.length)

    def first_block_is_two_tier(self) -> bool:
        """Whether the first block may carry the prompt: no self-drafter drafts on the full model's prefill, and the
        slim tier does not run in it (its pass would have to process the prompt as well)."""
        if isinstance(model_drafter_of(self.drafter), SelfDrafter):
            return False
        return self.tiers.slim is None or (self.controller is not None and not self.controller.use_slim())

    def open(self, state: DecodingState) -> None:
        """The first block, whose full pass processes the prompt too, as HF assisted generation's first call does:
        one sweep over the target's weights fewer than a prefill of its own.

        It runs only where the block is plain two-tier anyway (``first_block_is_two_tier``), and without a leaf,
        which would need a mask over the whole prompt. What it cost, mostly the prompt, teaches neither the draft
        planner nor the tier controller; what it accepted does."""
        speculating = self.speculates(state)
        draft = self.draft(state, slim_may_run=False)[0] if speculating else Draft([], [])
        block = two_tier(self.tiers, state, draft)
        self.drafter_read.observe_prefill(block.seconds["full"], block.rows.fed)
        self.commit(state, block)
        self.stats.record_block(block, drafted=len(draft.tokens), catch_up=False)
        self.stats.plain_blocks += int(not speculating)
        if self.planner is not None:
            self.planner.observe(draft, block.judged, block.kept)
        if self.check_invariants:
            state.target_cache.check()

    def step(self, state: DecodingState) -> None:
        """One block: draft, let a policy verify, commit, and tell the controllers what it cost; or, while speculation
        does not pay, one plain token."""
        if not self.speculates(state):
            self.plain_step(state)
            return
        reading = 0.0
        if not self.drafter_read.done:  # decoding began plainly: the drafter reads what it has not read, once
            reading = self.prefill_drafter(state)
        started = time.perf_counter()
        wants_slim = self.controller.use_slim() if self.controller is not None else True
        slim_may_run = self.tiers.slim is not None and wants_slim
        draft, drafting = self.draft(state, slim_may_run)
        cut_short = len(draft.tokens) == self.max_length - state.length - 1 < longest_draft(
            self.config, self.planner, slim_may_run)  # the length limit ended the draft, not the drafter
        slim_backlog = state.length - state.target_cache.length - 1
        must_catch_up = slim_backlog + len(draft.tokens) + 1 > self.config.max_slim_backlog
        slim_runs = self.tiers.slim is not None and wants_slim and bool(draft.tokens) and not must_catch_up
        shadow = slim_runs and self.controller is not None and self.controller.probes_in_shadow()
        tiers = self.chooser.tiers(self.tiers) if self.chooser is not None else self.tiers
        policy = shadow_tiered if shadow else self.slim_policy if slim_runs else two_tier
        if policy is two_tier and self.verifies_runner_up:  # a leaf rides only in a plain full pass
            threshold = self.planner.leaf_threshold(draft.confidences) if self.planner is not None else None
            draft.runner_up = runner_up(draft.tokens, draft.probs, threshold)
        self.stats.runner_up_blocks += int(draft.runner_up is not None)
        block = policy(tiers, state, draft)
        if self.chooser is not None:
            self.chooser.observe(block)
        self.commit(state, block)
        self.stats.record_block(block, drafted=len(draft.tokens), catch_up=must_catch_up)
        self.stats.peak_slim_backlog = max(self.stats.peak_slim_backlog, state.length - state.target_cache.length - 1)
        if self.planner is not None:
            self.planner.observe(draft, block.judged, block.kept)
            if isinstance(self.planner.costs, MeasuredCosts) and block.passes["full"]:
                self.planner.costs.observe_verifying(block.seconds["full"], block.rows.fed)
        seconds = time.perf_counter() - started
        if self.switch is not None:
            self.switch.observe(True, len(block.tokens), seconds, one_off=reading, cut_short=cut_short)
            if not (self.switch.speculates() or self.switch.speculating):  # fallen back, or a probe of speculation
                self.advise_fallback()  # kept decoding plain; not a probe of plain decoding while speculation pays
        if self.controller is not None:
            charged_to_slim = wants_slim or slim_backlog > 0
            self.controller.observe(block_cost(block, charged_to_slim, seconds, drafting, draft.forwards))
            self.stats.slim_on_blocks += int(wants_slim and not shadow)
            self.stats.slim_off_blocks += int(not wants_slim or shadow)
            self.stats.slim_shadow_blocks += int(shadow)
        if self.check_invariants:
            state.target_cache.check()

    def plain_step(self, state: DecodingState) -> None:
        """A block without a draft: one full pass gives one token, as ``generate`` decodes. Its seconds tell the
        switch what plain decoding costs; the first switch to it says once why (``fallback_advice``)."""
        started = time.perf_counter()
        block = two_tier(self.tiers, state, Draft([], []))
        self.commit(state, block)
        self.stats.record_block(block, drafted=0, catch_up=False)
        self.stats.plain_blocks += 1
        self.switch.observe(False, len(block.tokens), time.perf_counter() - started)
        self.planner.costs.observe_verifying(block.seconds["full"], block.rows.fed)  # the fit's one-token passes
        if self.check_invariants:
            state.target_cache.check()

    def advise_fallback(self) -> None:
        """Say once per model and drafter, with the measured numbers, that speculation does not pay here and why: where
        it measured clearly slower than plain decoding (``SpeculationSwitch.clearly_loses``), not on a near tie."""
        if self.switch.advised or not self.switch.clearly_loses():
            return
        self.switch.advised = True
        costs = self.planner.costs
        ratio = costs.verify_ratio() if isinstance(costs, MeasuredCosts) else None
        warnings.warn(f"{fallback_advice(self.model, ratio)} ({self.switch.describe()})", stacklevel=2)

    def draft(self, state: DecodingState, slim_may_run: bool) -> tuple[Draft, float]:
        """The drafter's proposal, as long as the draft length allows and leaving room for the verifier's token,
        and the seconds it took.

        The planner's stop rule ends a block; its bound is only a bound. A block the slim tier may
        verify is kept short enough for it (``3 · num_draft_tokens`` and below ``max_slim_backlog``);
        a block only the full model verifies may run to ``LONGEST_TWO_TIER_DRAFT``, as HF's assisted
        generation lets near-certain drafts run on."""
        room = self.max_length - state.length
        if room <= 1:
            return Draft([], []), 0.0
        started = time.perf_counter()
        longest = longest_draft(self.config, self.planner, slim_may_run)
        keep_drafting = self.planner.keep_drafting if self.planner is not None else None
        draft = self.drafter.draft(state.ids, min(longest, room - 1), self.rng, keep_drafting)
        seconds = time.perf_counter() - started
        self.stats.record_draft(draft.forwards, seconds)
        if self.planner is not None and isinstance(self.planner.costs, MeasuredCosts):
            self.planner.costs.observe_drafting(seconds, draft.forwards)
        return draft, seconds

    def commit(self, state: DecodingState, block: BlockResult) -> None:
        """Append the block's tokens one at a time, honouring max length and stopping criteria mid-block."""
        for row, (token, made_by) in enumerate(zip(block.tokens, block.made_by)):
            state.append(token)
            self.stats.record_commit(made_by)
            self.keep_outputs(state, block.rows, row)
            if self.streamer is not None:
                self.streamer.put(state.ids[:, -1:].cpu())
            if self.should_stop(state):
                self.finished = True
                return
        self.drafter.commit(state.ids)

    def keep_outputs(self, state: DecodingState, rows: TierLogits, row: int) -> None:
        """The committed token's processed scores and raw logits, shaped (1, vocab) as ``generate`` returns them."""
        if self.keep_scores:
            state.scores.append(rows.scores[row : row + 1])
        if self.keep_logits:
            state.logits.append(rows.logits[row : row + 1])

    def should_stop(self, state: DecodingState) -> bool:
        """Max length or a stopping criterion. Criteria get ``scores`` as ``generate`` passes them: the tuple of
        every new token's processed scores when ``output_scores`` keeps them, else ``None``."""
        scores = tuple(state.scores) if self.keep_scores else None
        return state.length >= self.max_length or bool(self.stopping_criteria(state.ids, scores).any())


def new_draft_planner(costs: StaticCosts, config: ViaSDConfig, do_sample: bool) -> DraftPlanner:
    """Draft lengths planned from measured costs (starting from ``costs``, with the switch to plain decoding) where
    timings may steer the output, else from ``costs``, the weight sizes."""
    switch = None
    if measures_wall_clock(config.tier_switching, config.mode == "lossless", do_sample):
        costs, switch = MeasuredCosts(costs), SpeculationSwitch() if config.plain_fallback else None
    return DraftPlanner(costs, longest=max(3 * config.num_draft_tokens, LONGEST_TWO_TIER_DRAFT), switch=switch)


def longest_draft(config: ViaSDConfig, planner: DraftPlanner | None, slim_may_run: bool) -> int:
    """A block's bound on its drafts: ``num_draft_tokens`` without a planner; with one, short enough for the slim
    tier where it may verify the block (``3 · num_draft_tokens`` and below ``max_slim_backlog``), else the planner's."""
    if planner is None:
        return config.num_draft_tokens
    if slim_may_run:
        return min(3 * config.num_draft_tokens, config.max_slim_backlog - 1)
    return planner.longest


def steers_attention(config: ViaSDConfig, do_sample: bool) -> bool:
    """Whether short-query attention runs the kernel measured fastest (``ViaSDConfig.attention``)."""
    if config.attention == "auto":
        return measures_wall_clock(config.tier_switching, config.mode == "lossless", do_sample)
    return config.attention == "measured"


def drafter_identity(drafter: Drafter) -> tuple:
    """What tells one drafter's measurements from another's: its kind, its model, the layers a self-drafter skips,
    its draft vocabulary and how much of the prompt it reads."""
    model_drafter = model_drafter_of(drafter)
    head, mask = getattr(model_drafter, "head", None), getattr(model_drafter, "mask", None)
    return (drafter.name, id(getattr(model_drafter, "model", None)), tuple(mask.kept_layers) if mask is not None else None,
            head.key if head is not None else None, getattr(model_drafter, "context", None))


def block_cost(block: BlockResult, charged_to_slim: bool, seconds: float, drafting: float, drafter_passes: int) -> BlockCost:
    """What the controller learns from a block (``drafting``: seconds spent drafting, in ``drafter_passes`` model
    passes; a block that only copied drafts has none, and its drafting counts as other seconds).

    ``charged_to_slim``: a block that clears tokens the slim tier committed pays the slim tier's
    debt (the full model must still process them), so it counts as a slim-tier block even when
    the slim tier is off; otherwise probes would bill one regime for the other.
    """
    return BlockCost(
        slim=charged_to_slim,
        seconds=seconds,
        tokens=len(block.tokens),
        slim_seconds=block.seconds["slim"],
        full_seconds=block.seconds["full"],
        repair_gain=block.repair_gain,
        slim_would_commit=block.slim_would_commit,
        drafter_seconds=drafting if drafter_passes else 0.0,
        drafter_passes=drafter_passes,
    )
