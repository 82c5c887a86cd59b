"""What a call's blocks teach, fed in one place per block: the draft planner (its costs and the drafter's calibrated
confidence), the speculation switch, the tier controller and hybrid drafting's copy-or-draft rule; and what they
report at the call's end (docs/design.md, "Deciding online").

Planner and controller are remembered on the model per drafter and batch size (``control.memory``): a pass over B rows
costs differently from one over another number of rows.
"""

from __future__ import annotations

import logging

from torch import nn

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import DraftPlanner, MeasuredCosts, StaticCosts, new_draft_planner
from viasd_hf.control.drafter_read import DrafterRead
from viasd_hf.control.fallback_advice import fallback_advice
from viasd_hf.control.memory import draft_planner, drafter_identity, planner_key, tier_choice, tier_memory
from viasd_hf.control.tier_controller import BlockCost
from viasd_hf.control.verdicts import VerdictStore
from viasd_hf.engine.batch.drafting import BatchDraft, BatchDrafter
from viasd_hf.engine.batch.stats import BatchViaSDStats
from viasd_hf.engine.policies import BlockResult
from viasd_hf.engine.shards import from_rank_zero, shards_of
from viasd_hf.masks.routing_mask import RoutingMask

logger = logging.getLogger("viasd_hf")


class Learners:
    """The deciders of one call (``planner``, ``switch``, ``controller``, ``drafter_read``; ``None`` where nothing
    is measured) and what each block teaches them."""

    def __init__(self, model: nn.Module, drafter: BatchDrafter, drafter_model: nn.Module | None, config: ViaSDConfig,
                 slim_mask: RoutingMask | None, batch_size: int, sampling: bool, emulated_bf16: bool,
                 verdicts: VerdictStore | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self.drafter_model = drafter_model
        self.verdicts = verdicts  # this machine's verdicts from earlier processes, and for later ones
        self.batch_size = batch_size
        self.emulated_bf16 = emulated_bf16  # the target is bf16 on a CPU without native bf16 (``advise_fallback``)
        key = (*drafter_identity(drafter, drafter_model, config), batch_size)
        chooses_tier = config.knobs.adaptive and slim_mask is not None
        self.controller = tier_choice(model, slim_mask, key, config, sampling) if chooses_tier else None
        self.planner_key = planner_key(key, slim_mask, config, sampling) if config.knobs.adaptive else None
        self.planner = None
        self.verdict = None  # where this machine keeps the switch's verdict for the next process (``control.verdicts``)
        if config.knobs.adaptive:
            self.planner = draft_planner(model, self.planner_key, lambda: self.new_planner(
                StaticCosts.for_drafter(model, drafter_model, drafter.mask), config, sampling, drafter_model))
        self.switch = self.planner.switch if self.planner is not None else None
        # where this call's switches start in the remembered controller's and speculation switch's records
        self._first_tier_switch = len(self.controller.switches) if self.controller is not None else 0
        self._first_fallback_switch = len(self.switch.switches) if self.switch is not None else 0
        # the seconds of the speculative blocks at the call's end (``add_to_tail``), and their tokens per row × rows
        self.tail = [0.0, 0.0]
        self.drafter_read = DrafterRead(self.switch)  # the drafter reads the prompts before its first draft
        if self.switch is not None:
            self.switch.call_begins()

    def new_planner(self, costs: StaticCosts, config: ViaSDConfig, sampling: bool,
                    drafter_model: nn.Module | None) -> DraftPlanner:
        """A planner for the first call of this process on its key; its switch resumes from what an earlier process
        learned on this machine (``control.verdicts``)."""
        planner = new_draft_planner(costs, config, do_sample=sampling)
        if planner.switch is not None and self.planner_key is not None and self.verdicts is not None:
            self.verdict = self.verdicts.path(self.model, drafter_model, self.planner_key)
            record = from_rank_zero(shards_of(self.model), lambda: self.verdicts.recall(self.verdict))  # all alike
            if record is not None:
                planner.switch.resume(record)
        return planner

    def plain(self, blocks: list[BlockResult], committed: int, seconds: float, measures: bool) -> None:
        """A plain block (one token per row, one full pass): its pace, and a verifying pass's cost, both only while the
        full batch decodes (``measures``): once rows have left, a pass costs less for the tokens it is fed."""
        if measures:
            self.switch.observe(False, committed, seconds)
            self.planner.costs.observe_verifying(blocks[0].seconds["full"], max(block.rows.fed for block in blocks))

    def block(self, draft: BatchDraft, blocks: list[BlockResult], committed: int, seconds: float, drafting: float,
              charged_to_slim: bool, reading: float, cut_short: bool, measures: bool, rows: int) -> None:
        """What the block teaches the planner, hybrid drafting's choice, the speculation switch and the tier controller
        (``measures``: the block's pace and passes tell the switch and the planner about this batch size; ``rows``:
        the rows it decoded; ``reading``: the seconds the drafter spent once, catching up with plain blocks, before
        the block; ``cut_short``: the length limit ended a row's draft, so its pace tells the switch nothing).

        ``charged_to_slim``: the slim tier ran, or the block clears tokens it committed (the full model must still
        process them, so the block pays the slim tier's debt and counts as a slim-tier block even when the tier is
        off); otherwise probes would bill one regime for the other."""
        if self.planner is not None:
            for row, block in zip(draft.rows, blocks):
                if row.drawn:
                    self.planner.observe(row.confidences, block.judged, block.kept)
            if isinstance(self.planner.costs, MeasuredCosts) and blocks[0].passes["full"] and measures:
                self.planner.costs.observe_verifying(blocks[0].seconds["full"], max(block.rows.fed for block in blocks))
        if self.switch is not None and measures:
            self.switch.observe(True, committed, seconds, one_off=reading, cut_short=cut_short)
        if self.switch is not None and self.batch_size > 1 and (cut_short or not measures):
            self.add_to_tail(seconds, committed, rows)  # rows finishing apart: a batch's cost, not one sequence's
        choice = getattr(self.drafter, "choice", None)  # hybrid drafting's copy-or-draft rule
        if choice is not None and draft.copied is not None:
            choice.observe(draft.copied, committed, draft.forwards)
        if self.controller is not None:
            would = [block.slim_would_commit for block in blocks if block.slim_would_commit is not None]
            self.controller.observe(BlockCost(
                slim=charged_to_slim, seconds=seconds, tokens=committed, slim_seconds=blocks[0].seconds["slim"],
                full_seconds=blocks[0].seconds["full"], repair_gain=sum(block.repair_gain for block in blocks),
                drafter_seconds=drafting if draft.forwards else 0.0, drafter_passes=draft.forwards,
                slim_would_commit=sum(would) if would else None,  # a shadow probe: what the slim tier would have
            ))

    def add_to_tail(self, seconds: float, tokens: int, rows: int) -> None:
        """A speculative block at the call's end (rows had left, or the length limit cut a draft short): its seconds,
        and its tokens as the full batch would commit them at these rows' pace (tokens per row × the batch's rows)."""
        self.tail[0] += seconds
        self.tail[1] += tokens * self.batch_size / rows

    def observe_tail(self) -> None:
        """Tell the switch what this call's end lost (``SpeculationSwitch.observe_tail``): its speculative blocks'
        seconds beyond their tokens, per row, at the full batch's speculative pace. Rows that left cost nothing here:
        a block of fewer rows commits fewer tokens in either regime. The rows left last are those that kept fewer
        drafts, so what the end loses is speculation's own."""
        seconds, tokens = self.tail
        pace = self.switch.speculative.mean()
        if seconds and pace:
            self.switch.observe_tail(seconds - tokens / pace)

    def advise_fallback(self) -> None:
        """Say once per model and drafter, in one line with the measured numbers, that speculation does not pay here
        and why: where it measured clearly slower than plain decoding (``SpeculationSwitch.clearly_loses``), not on a
        near tie."""
        if self.switch.advised or not self.switch.clearly_loses():
            return
        self.switch.advised = True
        costs = self.planner.costs
        ratio = costs.verify_ratio() if isinstance(costs, MeasuredCosts) else None
        logger.warning("viasd_hf: %s (%s)", fallback_advice(ratio, self.emulated_bf16), self.switch.describe())

    def finish(self, stats: BatchViaSDStats) -> None:
        """The call's switches and verdicts into ``stats``; the planner remembered for the next call."""
        if self.controller is not None:
            stats.tier_switches = self.controller.switches[self._first_tier_switch :]
            stats.slim_tier_verdict = self.controller.verdict()
        if self.switch is not None:
            self.observe_tail()
            self.advise_fallback()
            stats.speculation_switches = self.switch.switches[self._first_fallback_switch :]
            stats.speculation_verdict = self.drafter_read.verdict or self.switch.verdict()
        if self.planner_key is not None:
            tier_memory(self.model).remember_planner(self.planner_key, self.planner)
            if self.switch is not None and self.verdicts is not None:
                path = self.verdict or self.verdicts.path(self.model, self.drafter_model, self.planner_key)
                self.verdicts.remember(self.switch, path)
