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

The first block is plain and rides on the prompts' pass (``open``): the target reads every prompt and gives each
row its first token, as ``generate``'s first step does. Whether a later block drafts at all is the speculation
switch's choice (``control.speculation_switch``), on the tokens per second measured while every row of the batch
decodes (``measures``): where speculation does not pay, blocks decode one token per row in one full pass, as
``generate``'s batched greedy decoding. Whether the slim tier runs is the tier controller's choice, fed each block's
costs summed over its rows. Draft lengths come from the draft planner, asked row by row (``drafting``). Planner and
controller are remembered per batch size, apart from single-sequence calls': passes over more rows cost differently.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import LogitsProcessorList, StoppingCriteriaList

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import MeasuredCosts, StaticCosts
from viasd_hf.control.memory import draft_planner, planner_key, tier_choice, tier_memory
from viasd_hf.control.speculation_switch import DrafterRead
from viasd_hf.control.tier_controller import BlockCost
from viasd_hf.engine.attention import fastest_attention
from viasd_hf.engine.batch.acceptance import full_verdict, ragged, row_view
from viasd_hf.engine.batch.drafting import BatchDraft, BatchDrafter
from viasd_hf.engine.batch.ragged_cache import RaggedCache, right_padded
from viasd_hf.engine.batch.rows import Rows
from viasd_hf.engine.batch.stats import BatchViaSDStats
from viasd_hf.engine.loop import longest_draft, new_draft_planner, steers_attention
from viasd_hf.engine.policies import (
    BlockResult,
    SlimRepair,
    VerificationRules,
    after_slim_walk,
    decided,
    slim_repair,
    slim_walk,
)
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.state import CacheInvariantError
from viasd_hf.engine.verifier import TierLogits
from viasd_hf.masks.layer_skipping import skipping
from viasd_hf.masks.routing_mask import RoutingMask


class BatchedDecoder:
    """One batched ``generate`` call's worth of lossless VIA-SD (sampling with ``rng``, else greedy); ``run`` returns
    the rows."""

    def __init__(self, model: nn.Module, drafter: BatchDrafter, drafter_model: nn.Module | None, config: ViaSDConfig,
                 slim_mask: RoutingMask | None, logits_processor: LogitsProcessorList,
                 stopping_criteria: StoppingCriteriaList, max_length: int, target: RaggedCache,
                 rng: RandomStream | None = None, check_invariants: bool = False, keep_scores: bool = False,
                 keep_logits: bool = False) -> None:
        self.model = model
        self.drafter = drafter
        self.target = target  # the target's cache, empty until ``run`` (the self-drafter drafts on it too)
        self.config = config
        self.skipped = slim_mask.skipped_layers if slim_mask is not None else None
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.max_length = max_length
        self.check_invariants = check_invariants
        self.keep = {"keep_scores": keep_scores, "keep_logits": keep_logits}  # output_scores, output_logits
        self.rng = rng  # every random draw of a sampling call; None: greedy
        self.rules = VerificationRules(config, rng)
        self.tiered = config.mode == "tiered"
        self.batch_size = target.mask.shape[0]
        sampling = rng is not None
        self.stats = BatchViaSDStats()
        # a pass over B rows costs differently from a single sequence's, and from one over another number of rows; an
        # assistant reading part of each prompt, or drafting over a vocabulary, drafts differently
        context = config.drafter_context if drafter_model is not None else None
        vocabulary = drafter.head.key if drafter.head is not None else None
        key = (drafter.name, id(drafter_model), context, vocabulary, "batch", self.batch_size)
        chooses_tier = config.adaptive and slim_mask is not None
        self.controller = tier_choice(model, slim_mask, key, config, sampling) if chooses_tier else None
        self.planner_key = planner_key(key, slim_mask, config, sampling) if config.adaptive else None
        self.planner = None
        if config.adaptive:
            self.planner = draft_planner(model, self.planner_key, lambda: new_draft_planner(
                StaticCosts.for_drafter(model, drafter_model, None), config, do_sample=sampling))
        self.switch = self.planner.switch if self.planner is not None else None
        # where this call's switches start in the remembered controller's and speculation switch's records
        self._first_tier_switch = len(self.controller.switches) if self.controller is not None else 0
        self._first_fallback_switch = len(self.switch.switches) if self.switch is not None else 0
        self.rows: Rows
        # the seconds of the speculative blocks at the call's end (``add_to_tail``), and their tokens per row × rows
        self.tail = [0.0, 0.0]
        self.drafter_read = DrafterRead(self.switch)  # the drafter reads the prompts before its first draft

    def run(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rows:
        """Decode every row of ``input_ids`` (left-padded as ``prompt_mask`` says) until each one stops."""
        started = time.perf_counter()
        self.rows = Rows(input_ids, prompt_mask, self.stopping_criteria, self.max_length, **self.keep)
        with fastest_attention(steers_attention(self.config, self.rng is not None)):
            self.open(input_ids, prompt_mask)
            self.leave()
            if len(self.rows) and self.speculates():
                self.read_drafts()
            while len(self.rows):
                self.step()
                self.leave()
        self.finish(started)
        return self.rows

    def open(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """The first block, a plain one: the target reads every prompt and gives each row its first token, as
        ``generate``'s first step does. The drafter reads the prompts after it, where the next block drafts."""
        started = time.perf_counter()
        logits = self.target.run(self.model, input_ids, prompt_mask.bool(), keep=1)
        seconds = time.perf_counter() - started
        self.drafter_read.observe_prefill(seconds, prompt_mask.numel())  # a batched pass computes every column
        empty = BatchDraft.empty(len(self.rows))
        fed = prompt_mask.sum(-1).tolist()
        views = [row_view(logits[i], row, [], self.logits_processor, seconds, fed[i])
                 for i, row in enumerate(self.rows.active)]
        self.commit(self.judge(views, empty.tokens, empty, None, None), empty)
        self.stats.plain_blocks += 1
        for row in self.rows.active:
            row.stats.plain_blocks += 1

    def unread_tokens(self) -> int:
        """The columns the drafter's read would compute (``BatchDrafter.unread``), until it has read."""
        return 0 if self.drafter_read.done else self.drafter.unread(self.rows)

    def read_drafts(self) -> float:
        """The drafter reads what the rows committed and it has not read; the seconds it took."""
        tokens = self.unread_tokens()
        started = time.perf_counter()
        passes = self.drafter.read(self.rows)
        seconds = time.perf_counter() - started
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
        started = time.perf_counter()
        wants_slim = self.wants_slim()
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
        self.stats.slim_forwards += int(slim_runs)
        self.stats.slim_on_blocks += int(wants_slim and not shadow)
        self.stats.slim_off_blocks += int(not wants_slim or shadow)
        self.stats.slim_shadow_blocks += int(shadow)
        self.learn(draft, blocks, committed, time.perf_counter() - started, drafting, wants_slim, reading, cut_short)

    def plain_step(self) -> None:
        """A block without a draft: one full pass gives one token per row, as ``generate`` decodes a batch."""
        started = time.perf_counter()
        empty = BatchDraft.empty(len(self.rows))
        blocks = self.verify(empty, None, None)
        committed = self.commit(blocks, empty)
        self.stats.plain_blocks += 1
        for row in self.rows.active:
            row.stats.plain_blocks += 1
        if self.measures():
            self.switch.observe(False, committed, time.perf_counter() - started)
        self.planner.costs.observe_verifying(blocks[0].seconds["full"], max(block.rows.fed for block in blocks))

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
        started = time.perf_counter()
        keep_drafting = self.planner.keep_drafting_rows if self.planner is not None else None
        draft = self.drafter.draft(self.rows, limits, self.rng, keep_drafting)
        seconds = time.perf_counter() - started
        self.record_draft(draft.forwards, seconds)
        if self.planner is not None and isinstance(self.planner.costs, MeasuredCosts):
            self.planner.costs.observe_drafting(seconds, draft.forwards)
        return draft, seconds

    def must_catch_up(self, draft: BatchDraft) -> bool:
        """Tiered mode: whether some row's backlog (tokens the slim tier committed that the full model has not seen)
        would pass ``max_slim_backlog`` with this block, so the full model verifies it, as for one sequence."""
        return self.tiered and any(row.unverified + len(tokens) + 1 > self.config.max_slim_backlog
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
        if not shadow and all(verdict is not None and not verdict.escalated for verdict in verdicts):
            return [decided(row, verdict, view, "slim") for row, verdict, view in zip(draft.rows, verdicts, views)]
        blocks = self.verify(draft, None, None)
        return [after_slim_walk(block, view, row, verdict, shadow)
                for block, view, row, verdict in zip(blocks, views, draft.rows, verdicts)]

    def verify(self, draft: BatchDraft, repairs: list[SlimRepair] | None,
               slim_views: list[TierLogits] | None) -> list[BlockResult]:
        """The full pass over every row's (repaired) draft; each row's verdict. The cache keeps what each row kept."""
        verified = [repair.verified.tokens for repair in repairs] if repairs is not None else draft.tokens
        return self.judge(self.score(verified, routed=False), verified, draft, repairs, slim_views)

    def judge(self, views: list[TierLogits], verified: list[list[int]], draft: BatchDraft,
              repairs: list[SlimRepair] | None, slim_views: list[TierLogits] | None) -> list[BlockResult]:
        """Each row's verdict from the full pass's ``views`` of its ``verified`` tokens; the cache forgets the rest."""
        blocks = [full_verdict(self.rules, view, draft.rows[i], repairs[i] if repairs else None,
                               slim_views[i] if slim_views else None) for i, view in enumerate(views)]
        rejected = [len(tokens) - block.kept for tokens, block in zip(verified, blocks)]
        self.target.forget_last(torch.tensor(rejected, device=self.target.mask.device))
        self.stats.full_forwards += 1
        self.stats.seconds["full"] += views[0].seconds
        if slim_views:
            self.stats.seconds["slim"] += slim_views[0].seconds
        return blocks

    def score(self, drafts: list[list[int]], routed: bool) -> list[TierLogits]:
        """One pass of the target (``routed``: the slim verifier, provisional) over each row's unprocessed committed
        tokens and draft: what each row's pass says about its draft (``row_view``)."""
        feeds = [row.unprocessed() + tokens for row, tokens in zip(self.rows.active, drafts)]
        tokens, real = right_padded(feeds, self.target.mask.device)
        started = time.perf_counter()
        if routed:
            with self.target.provisional(), skipping(self.model, self.skipped):
                logits = self.target.run(self.model, tokens, real, keep=tokens.shape[1])
        else:
            logits = self.target.run(self.model, tokens, real, keep=tokens.shape[1])
        seconds = time.perf_counter() - started
        return [row_view(logits[i, len(feed) - len(draft) - 1 :], row, draft, self.logits_processor, seconds, len(feed))
                for i, (row, feed, draft) in enumerate(zip(self.rows.active, feeds, drafts))]

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

    def learn(self, draft: BatchDraft, blocks: list[BlockResult], committed: int, seconds: float, drafting: float,
              wants_slim: bool, reading: float, cut_short: bool) -> None:
        """What the block teaches the planner, the speculation switch and the tier controller (``reading``: the seconds
        the drafter spent once, catching up with plain blocks, before the block; ``cut_short``: the length limit ended
        a row's draft, so its pace tells the switch nothing)."""
        if self.planner is not None:
            for row, block in zip(draft.rows, blocks):
                self.planner.observe(row, block.judged, block.kept)
            if isinstance(self.planner.costs, MeasuredCosts) and blocks[0].passes["full"]:
                self.planner.costs.observe_verifying(blocks[0].seconds["full"], max(block.rows.fed for block in blocks))
        if self.switch is not None and self.measures():
            self.switch.observe(True, committed, seconds, one_off=reading, cut_short=cut_short)
        if self.switch is not None and (cut_short or not self.measures()):
            self.add_to_tail(seconds, committed)
        if self.controller is not None:
            self.controller.observe(BlockCost(
                slim=wants_slim, seconds=seconds, tokens=committed, slim_seconds=blocks[0].seconds["slim"],
                full_seconds=blocks[0].seconds["full"], repair_gain=sum(block.repair_gain for block in blocks),
                drafter_seconds=drafting if draft.forwards else 0.0, drafter_passes=draft.forwards,
            ))

    def add_to_tail(self, seconds: float, tokens: int) -> None:
        """A speculative block at the call's end (rows had left, or the length limit cut a draft short): its seconds,
        and its tokens as the full batch would commit them at these rows' pace (tokens per row × the batch's rows)."""
        self.tail[0] += seconds
        self.tail[1] += tokens * self.batch_size / len(self.rows)

    def observe_tail(self) -> None:
        """Tell the switch what this call's end lost (``SpeculationSwitch.observe_tail``): its speculative blocks'
        seconds beyond their tokens, per row, at the full batch's speculative pace. Rows that left cost nothing here:
        a block of fewer rows commits fewer tokens in either regime. The rows left last are those that kept fewer
        drafts, so what the end loses is speculation's own."""
        seconds, tokens = self.tail
        pace = self.switch.speculative.mean()
        if seconds and pace:
            self.switch.observe_tail(seconds - tokens / pace)

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
        if self.controller is not None:
            stats.tier_switches = self.controller.switches[self._first_tier_switch :]
            stats.slim_tier_verdict = self.controller.verdict()
        if self.switch is not None:
            self.observe_tail()
            stats.speculation_switches = self.switch.switches[self._first_fallback_switch :]
            stats.speculation_verdict = self.drafter_read.verdict or self.switch.verdict()
        if self.planner_key is not None:
            tier_memory(self.model).remember_planner(self.planner_key, self.planner)
        stats.seconds["total"] = time.perf_counter() - started

