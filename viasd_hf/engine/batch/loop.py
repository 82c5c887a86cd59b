"""The batched VIA-SD decode loop (lossless or tiered, greedy or sampling): every row of a left-padded batch decodes
at once.

One block, as in the paper's algorithm, for all rows together:

1. ``draft``: the drafter proposes up to γ tokens for every row (``drafting``);
2. ``repair``: where the slim tier runs, the target routed with the slim mask scores every row's
   draft in one provisional pass, and each row's first draft it would not keep is replaced by its
   own token (``policies.slim_repair``); in tiered mode the slim tier instead decides the block when
   no row is unsure of a draft (``slim_decides``), else the block escalates as a whole;
3. ``verify``: one full pass scores every row's unprocessed committed tokens and (repaired) draft; each
   row keeps the prefix the full model agrees with and gets the full model's token after it, so rows
   keep different numbers of tokens (``acceptance.full_verdict``; ``ragged_cache`` holds the rest as holes);
4. ``commit``: each row's tokens one at a time, until its own stopping criteria (``rows``);
5. ``leave``: rows that finished leave every tensor, and a cache whose holes pile up is compacted.

The target reads the prompts in the first block's pass (``open``): where that block speculates and only the full
model verifies it, the pass carries every row's first draft after its prompt, as HF assisted generation's first call
does; where it does not speculate, it gives each row its first token, as ``generate``'s first step does; where the
slim tier or a self-drafter reads the target's cache, the full model reads the prompts first (``prefill``). Prompts of
very different lengths are read one row a pass (``RaggedCache.read``), not padded to the longest as batched ``generate``
pads them. Whether a later block drafts at all is the speculation
switch's choice (``control.speculation_switch``), on the tokens per second measured while every row of the batch
decodes (``measures``): where speculation does not pay, blocks decode one token per row in one full pass, as
``generate``'s batched greedy decoding. Whether the slim tier runs is the tier controller's choice, fed each block's
costs summed over its rows. Draft lengths come from the draft planner, asked row by row (``drafting``). Planner and
controller are remembered per batch size: passes over more rows cost differently. A single prompt is a batch of one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import MeasuredCosts, longest_draft
from viasd_hf.control.tier_controller import measures_wall_clock
from viasd_hf.control.verdicts import VerdictStore
from viasd_hf.engine.attention import fastest_attention
from viasd_hf.engine.batch.acceptance import full_verdict, ragged, row_view, scored, scored_beside
from viasd_hf.engine.batch.drafting import BatchDraft, BatchDrafter
from viasd_hf.engine.batch.learning import Learners
from viasd_hf.engine.batch.ragged_cache import RaggedCache, right_padded
from viasd_hf.engine.batch.rows import Rows
from viasd_hf.engine.batch.second_choices import Beside, kept_second_choices, verifies_beside, worth_verifying
from viasd_hf.engine.batch.stats import BatchViaSDStats
from viasd_hf.engine.clock import Clock
from viasd_hf.engine.policies import (
    BlockResult,
    SlimRepair,
    VerificationRules,
    after_slim_walk,
    decided,
    slim_repair,
    slim_walk,
)
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.verifier import TierLogits
from viasd_hf.masks.routing_mask import RoutingMask

logger = logging.getLogger("viasd_hf")


class CacheInvariantError(AssertionError):
    """The target's cache no longer holds exactly the tokens the full model has processed."""


class BatchedDecoder:
    """One batched ``generate`` call's worth of lossless VIA-SD (sampling with ``rng``, else greedy); ``run`` returns
    the rows."""

    def __init__(self, model: nn.Module, drafter: BatchDrafter, drafter_model: nn.Module | None, config: ViaSDConfig,
                 slim_mask: RoutingMask | None, processors: RowProcessors,
                 stopping_criteria: StoppingCriteriaList, max_length: int, target: RaggedCache,
                 rng: RandomStream | None = None, check_invariants: bool = False, keep_scores: bool = False,
                 keep_logits: bool = False, streamer: BaseStreamer | None = None, emulated_bf16: bool = False,
                 clock: Clock | None = None, verdicts: VerdictStore | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self.clock = clock if clock is not None else Clock()  # every timing of the call (``engine.clock``)
        self.drafter_model = drafter_model  # its attention steered with the target's (``run``)
        self.target = target  # the target's cache, empty until ``run`` (the self-drafter drafts on it too)
        self.config = config
        self.skipped = slim_mask.skipped_layers if slim_mask is not None else None
        self.processors = processors
        self.stopping_criteria = stopping_criteria
        self.max_length = max_length
        self.check_invariants = check_invariants
        self.keep = {"keep_scores": keep_scores, "keep_logits": keep_logits}  # output_scores, output_logits
        self.streamer = streamer  # a batch of one only (``preconditions``)
        self.rng = rng  # every random draw of a sampling call; None: greedy
        self.rules = VerificationRules(config, rng)
        self.tiered = config.mode == "tiered"
        # lossless greedy blocks verify the drafter's second choices beside the draft, where the target allows
        self.beside = not self.tiered and verifies_beside(model, target, greedy=rng is None)
        self.batch_size = target.mask.shape[0]
        self.stats = BatchViaSDStats()
        self.learners = Learners(model, drafter, drafter_model, config, slim_mask, self.batch_size, rng is not None,
                                 emulated_bf16, verdicts)
        # the learners' deciders, as the loop asks them
        self.controller, self.planner = self.learners.controller, self.learners.planner
        self.switch, self.drafter_read = self.learners.switch, self.learners.drafter_read
        self.rows: Rows

    def run(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rows:
        """Decode every row of ``input_ids`` (left-padded as ``prompt_mask`` says) until each one stops."""
        started = self.clock.now()
        self.rows = Rows(input_ids, prompt_mask, self.stopping_criteria, self.max_length, streamer=self.streamer,
                         **self.keep)
        steered = measures_wall_clock(self.config.reproducible, self.config.mode == "lossless", self.rng is not None)
        with fastest_attention((self.model, self.drafter_model), steered):
            if not self.speculates():
                self.open(input_ids, prompt_mask)
            elif self.first_block_is_two_tier():
                self.read_drafts()
                self.open(input_ids, prompt_mask, self.draft(slim_may_run=False)[0])
            else:
                self.read_drafts()
                self.prefill(input_ids, prompt_mask)
            self.leave()
            while len(self.rows):
                self.step()
                self.leave()
        if self.streamer is not None:
            self.streamer.end()
        self.finish(started)
        return self.rows

    def first_block_is_two_tier(self) -> bool:
        """Whether the first block may carry the prompts: no self-drafter drafts on the target's cache (empty yet), and
        the slim tier does not run in it (its pass would have to read the prompts as well)."""
        if self.drafter.mask is not None:
            return False
        return self.skipped is None or (self.controller is not None and not self.controller.use_slim())

    def open(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, draft: BatchDraft | None = None) -> None:
        """The first block, whose full pass reads every prompt and, where it carries a ``draft``, each row's draft
        after its prompt, as HF assisted generation's first call does; without one, each row gets its first token, as
        ``generate``'s first step gives it. What the pass cost, mostly the prompts, teaches neither the draft planner's
        costs nor the tier controller; what it accepted teaches the planner's calibration."""
        draft = draft if draft is not None else BatchDraft.empty(len(self.rows))
        drafted, drafted_real = right_padded(draft.tokens, self.target.mask.device)
        tokens, real = torch.cat([input_ids, drafted], dim=-1), torch.cat([prompt_mask.bool(), drafted_real], dim=-1)
        started = self.clock.now()
        logits, columns = self.target.read(self.model, tokens, real, keep=draft.longest + 1)
        seconds = self.clock.since(started)
        self.drafter_read.observe_prefill(seconds, columns)
        fed = real.sum(-1).tolist()
        views = [row_view(logits[i], row, row_draft, self.processors, seconds, fed[i])
                 for i, (row, row_draft) in enumerate(zip(self.rows.active, draft.tokens))]
        blocks = self.judge(views, draft.tokens, draft, None, None)
        self.commit(blocks, draft)
        if self.planner is not None:
            for row, block in zip(draft.rows, blocks):
                if row.drawn:
                    self.planner.observe(row.confidences, block.judged, block.kept)
        if not draft.longest:
            self.stats.plain_blocks += 1
            for row in self.rows.active:
                row.stats.plain_blocks += 1

    def prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """Where the first block drafts but cannot carry the prompts (the slim tier or a self-drafter reads the
        target's cache), the full model reads each prompt but its newest token, which opens the first block."""
        if input_ids.shape[1] <= 1:
            return  # nothing before the token that opens the first block
        started = self.clock.now()
        _, columns = self.target.read(self.model, input_ids[:, :-1], prompt_mask[:, :-1].bool(), keep=1)
        seconds = self.clock.since(started)
        self.drafter_read.observe_prefill(seconds, columns)
        self.stats.record_prefill(seconds)
        for row in self.rows.active:
            row.stats.record_prefill(seconds)

    def unread_tokens(self) -> int:
        """The columns the drafter's read would compute (``BatchDrafter.unread``), until it has read."""
        return 0 if self.drafter_read.done else self.drafter.unread(self.rows)

    def read_drafts(self) -> float:
        """The drafter reads what the rows committed and it has not read; the seconds it took."""
        tokens = self.unread_tokens()
        started = self.clock.now()
        passes = self.drafter.read(self.rows)
        seconds = self.clock.since(started)
        self.record_draft(passes, seconds)
        self.drafter_read.observe_read(seconds, tokens)
        return seconds

    def speculates(self) -> bool:
        """Whether the next block drafts (``SpeculationSwitch``; always, where timings may not steer). A drafter that
        has not read the prompts drafts only where its read is expected to pay (``reading_pays``). Once rows have
        left, the regime chosen for the full batch goes on, without probes (``measures``)."""
        if self.switch is None:
            return True
        chosen = self.switch.speculates() if self.measures() else self.switch.speculating
        return chosen and (self.drafter_read.done or self.reading_pays())

    def measures(self) -> bool:
        """Whether a block's pace tells the switch about this batch size: while every row of the batch decodes. Once
        rows have left, a block costs less and commits fewer tokens whichever regime runs it, so its pace would set
        a regime measured late in a call against one measured on the full batch."""
        return len(self.rows) == self.batch_size

    def reading_pays(self) -> bool:
        """Whether speculating over the tokens the rows may still decode saves more than the drafter's read costs
        (``DrafterRead.pays``, priced against this call's prefill)."""
        left = sum(self.max_length - row.length for row in self.rows.active)
        return self.drafter_read.pays(self.unread_tokens(), left)

    def wants_slim(self) -> bool:
        """Whether the slim tier may run in the next block (the controller's choice, where there is one)."""
        if self.skipped is None:
            return False
        return self.controller.use_slim() if self.controller is not None else True

    def step(self) -> None:
        """One block for every row: draft, repair, verify, commit; or, while speculation does not pay, one plain token."""
        if not self.speculates():
            self.plain_step()
            return
        reading = 0.0 if self.drafter_read.done else self.read_drafts()  # decoding began plainly: read, once
        started = self.clock.now()
        wants_slim = self.wants_slim()
        owes = any(row.unverified for row in self.rows.active)  # tokens the slim tier committed, unseen by the full model
        draft, drafting = self.draft(slim_may_run=wants_slim)
        cut_short = self.cut_short(draft, wants_slim)
        catch_up = self.must_catch_up(draft)
        slim_runs = wants_slim and draft.longest > 0 and not catch_up
        shadow = slim_runs and self.tiered and self.controller is not None and self.controller.probes_in_shadow()
        if not slim_runs:
            blocks = self.verify(draft, None, None)
        elif self.tiered:
            blocks = self.slim_decides(draft, shadow)
        else:
            blocks = self.verify(draft, *self.repair(draft))
        committed = self.commit(blocks, draft, catch_up)
        self.stats.catch_up_blocks += int(catch_up)
        self.stats.slim_forwards += int(slim_runs)
        self.stats.slim_on_blocks += int(wants_slim and not shadow)
        self.stats.slim_off_blocks += int(not wants_slim or shadow)
        self.stats.slim_shadow_blocks += int(shadow)
        self.learners.block(draft, blocks, committed, self.clock.since(started), drafting, wants_slim or owes,
                            reading, cut_short, self.measures(), len(self.rows))

    def plain_step(self) -> None:
        """A block without a draft: one full pass gives one token per row, as ``generate`` decodes a batch."""
        started = self.clock.now()
        empty = BatchDraft.empty(len(self.rows))
        blocks = self.verify(empty, None, None)
        committed = self.commit(blocks, empty)
        self.stats.plain_blocks += 1
        for row in self.rows.active:
            row.stats.plain_blocks += 1
        self.learners.plain(blocks, committed, self.clock.since(started), self.measures())

    def limits(self, slim_may_run: bool) -> list[int]:
        """Each row's longest draft: the block's bound (the planner's, shorter where the slim tier may run, as for one
        sequence), or less where the row's room before ``max_length`` is less."""
        longest = longest_draft(self.config, self.planner, slim_may_run)
        return [max(0, min(longest, self.max_length - row.length - 1)) for row in self.rows.active]

    def cut_short(self, draft: BatchDraft, slim_may_run: bool) -> bool:
        """Whether the length limit, not the drafter, ended some row's draft (the last blocks of a call)."""
        longest = longest_draft(self.config, self.planner, slim_may_run)
        return any(len(tokens) == limit < longest for tokens, limit in zip(draft.tokens, self.limits(slim_may_run)))

    def draft(self, slim_may_run: bool) -> tuple[BatchDraft, float]:
        """Every row's draft, each as long as ``limits`` allows, and the seconds it took. A drafter that has not read
        the prompts (decoding began plainly) reads what it lacks in its first pass."""
        limits = self.limits(slim_may_run)
        started = self.clock.now()
        keep_drafting = self.planner.keep_drafting_rows if self.planner is not None else None
        draft = self.drafter.draft(self.rows, limits, self.rng, keep_drafting)
        seconds = self.clock.since(started)
        self.record_draft(draft.forwards, seconds)
        if self.planner is not None and isinstance(self.planner.costs, MeasuredCosts) and self.measures():
            self.planner.costs.observe_drafting(seconds, draft.forwards)
        return draft, seconds

    def must_catch_up(self, draft: BatchDraft) -> bool:
        """Tiered mode: whether some row's backlog (tokens the slim tier committed that the full model has not seen)
        would pass ``max_slim_backlog`` with this block, so the full model verifies it, as for one sequence."""
        return self.tiered and any(row.unverified + len(tokens) + 1 > self.config.knobs.max_slim_backlog
                                   for row, tokens in zip(self.rows.active, draft.tokens))

    def repair(self, draft: BatchDraft) -> tuple[list[SlimRepair], list[TierLogits]]:
        """Lossless mode: the slim tier's provisional pass over every row's draft, and each row's repair."""
        views = self.score(draft.tokens, routed=True)
        return [slim_repair(self.rules, view, row) for view, row in zip(views, draft.rows)], views

    def slim_decides(self, draft: BatchDraft, shadow: bool) -> list[BlockResult]:
        """Tiered mode (``policies.tiered``, row by row): the slim tier walks every row's draft; where no row is unsure
        of a draft, each row commits on its authority and the target's cache takes those tokens with the full model's
        next pass. Otherwise the block escalates as a whole: the full pass an unsure row needs verifies every row's
        draft for the price of one pass. A ``shadow`` probe of the slim tier is decided by the full model in any
        case."""
        views = self.score(draft.tokens, routed=True)
        verdicts = [slim_walk(self.rules, view, row) for view, row in zip(views, draft.rows)]
        self.stats.seconds["slim"] += views[0].seconds
        if not shadow and not any(verdict.escalated for verdict in verdicts):
            return [decided(row, verdict, view, "slim") for row, verdict, view in zip(draft.rows, verdicts, views)]
        blocks = self.verify(draft, None, None)
        return [after_slim_walk(block, view, row, verdict, shadow)
                for block, view, row, verdict in zip(blocks, views, draft.rows, verdicts)]

    def verify(self, draft: BatchDraft, repairs: list[SlimRepair] | None,
               slim_views: list[TierLogits] | None) -> list[BlockResult]:
        """The full pass over every row's (repaired) draft, and beside it the drafter's second choices where the block
        verifies them (``second_choices``); each row's verdict. The cache keeps what each row kept."""
        if repairs is None and self.beside and self.planner is not None:
            worth = worth_verifying(self.planner, draft.rows)
            views, beside = scored_beside(self.model, self.target, self.rows, draft.rows, worth, self.processors,
                                          self.clock)
            return self.judge(views, draft.tokens, draft, None, slim_views, beside)
        verified = [repair.verified.tokens for repair in repairs] if repairs is not None else draft.tokens
        return self.judge(self.score(verified, routed=False), verified, draft, repairs, slim_views)

    def judge(self, views: list[TierLogits], verified: list[list[int]], draft: BatchDraft,
              repairs: list[SlimRepair] | None, slim_views: list[TierLogits] | None,
              beside: list[list[Beside]] | None = None) -> list[BlockResult]:
        """Each row's verdict from the full pass's ``views`` of its ``verified`` tokens (and of the second choices fed
        ``beside`` them); the cache forgets the rest."""
        blocks = [full_verdict(self.rules, view, draft.rows[i], repairs[i] if repairs else None,
                               slim_views[i] if slim_views else None) for i, view in enumerate(views)]
        beside = beside if beside is not None else [[] for _ in blocks]
        if self.beside and self.planner is not None and repairs is None:
            blocks = kept_second_choices(blocks, views, draft.rows, beside, self.rows.active, self.processors,
                                         self.target, self.planner)
        rejected = [len(tokens) + len(fed) - block.kept - int(block.second_choice_kept)
                    for tokens, fed, block in zip(verified, beside, blocks)]
        self.target.forget_last(torch.tensor(rejected, device=self.target.mask.device))
        self.stats.full_forwards += 1
        self.stats.seconds["full"] += views[0].seconds
        if slim_views:
            self.stats.seconds["slim"] += slim_views[0].seconds
        return blocks

    def score(self, drafts: list[list[int]], routed: bool) -> list[TierLogits]:
        """One pass of the target (``routed``: the slim verifier) over every row's draft (``acceptance.scored``)."""
        return scored(self.model, self.target, self.rows, drafts, self.skipped if routed else None,
                      self.processors, self.clock)

    def commit(self, blocks: list[BlockResult], draft: BatchDraft, catch_up: bool = False) -> int:
        """Each row's tokens, until its stopping criteria; the drafter forgets what was not committed. Returns the
        tokens committed over all rows."""
        committed = 0
        for row, block, tokens in zip(self.rows.active, blocks, draft.tokens):
            row.stats.record_block(block, drafted=len(tokens), catch_up=catch_up)
            taken = self.rows.commit(row, block)
            row.unverified = row.unverified + taken if block.decided_by == "slim" else 0
            row.stats.peak_slim_backlog = max(row.stats.peak_slim_backlog, row.unverified)
            committed += taken
        self.stats.blocks += 1
        self.stats.ragged_blocks += int(ragged(blocks))
        self.drafter.commit(self.rows)
        if self.check_invariants:
            self.check()
        return committed

    def leave(self) -> None:
        """Rows that finished leave the batch (every tensor, caches included); caches compact when holes pile up."""
        if any(row.finished for row in self.rows.active):
            staying = self.rows.staying()
            for row in self.rows.leave():
                self.stats.rows_left.append({"row": row.origin, "block": self.stats.blocks, "new_tokens": row.new_tokens})
            if len(self.rows):
                self.target.select(staying.to(self.target.mask.device))
                self.drafter.select(staying)
        if len(self.rows):
            self.target.compact_if_worth_it()
            self.drafter.tidy()
            self.stats.peak_hole_share = max(self.stats.peak_hole_share, self.target.hole_share())

    def record_draft(self, passes: int, seconds: float) -> None:
        self.stats.record_draft(passes, seconds)
        for row in self.rows.active:
            row.stats.record_draft(passes, seconds)

    def check(self) -> None:
        """Each row still decoding has its committed tokens but the newest (which opens the next block) in the target's
        cache; a row that stopped inside the block is about to leave it."""
        going_on = [i for i, row in enumerate(self.rows.active) if not row.finished]
        lengths = self.target.lengths().tolist()
        held = [lengths[i] for i in going_on]
        expected = [len(self.rows.active[i].tokens()) - 1 - self.rows.active[i].unverified for i in going_on]
        if held != expected:
            raise CacheInvariantError(f"the target's cache holds {held} tokens per row, not {expected}")

    def finish(self, started: float) -> None:
        stats = self.stats
        stats.total_rows([row.stats for row in self.rows.every_row()])
        stats.compactions = {"target": self.target.compactions, "drafter": self.drafter.compactions}
        self.learners.finish(stats)
        stats.seconds["total"] = self.clock.since(started)
