"""Drafters for a batch: an assistant model on a ragged cache of its own, prompt lookup per row, the two together, and
the self-drafter (the target routed) on the target's cache.

Each block drafts for every row at once. The block has one length, the longest any row drafts:
each row drafts until its own stop (its length limit, an end token, or, without a draft planner,
the assistant's confidence threshold, as HF assisted generation), and the assistant's passes go on
while any row still drafts; a row that stopped feeds holes. With a planner the batch stops together,
when one more column is no longer worth what it costs the whole block
(``DraftPlanner.keep_drafting_rows``): every row pays for the verifying pass's width, but only the
rows still drafting gain from it, so batches draft shorter than their rows would alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from viasd_hf.control.hybrid_choice import CopyOrDraft
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.batch.model_drafts import (
    Reader,
    drafted_token,
    kept_prefix,
    reading_model,
    second_choice,
    unread_window,
)
from viasd_hf.engine.batch.ragged_cache import RaggedCache, right_padded
from viasd_hf.engine.batch.rows import Row, Rows
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.masks.layer_skipping import skipping
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.vocabulary.head import SubsetHead

# each row's draft confidences so far and whether the row may go on -> does the batch draft one more column?
KeepDraftingRows = Callable[[list[list[float]], list[bool]], bool]


@dataclass
class BatchDraft:
    """Each active row's draft (``accept.Draft``: its tokens and, where a model drew them, the distributions they were
    drawn from; ``None`` for copied tokens) and the drafter's batched passes."""

    rows: list[Draft]
    forwards: int = 0
    copied: bool | None = None  # hybrid drafting, where some row could copy: whether the block copied (else None)

    @classmethod
    def empty(cls, rows: int) -> BatchDraft:
        return cls([Draft([], []) for _ in range(rows)])

    @property
    def tokens(self) -> list[list[int]]:
        return [draft.tokens for draft in self.rows]

    @property
    def longest(self) -> int:
        return max((len(draft.tokens) for draft in self.rows), default=0)


class BatchDrafter(Protocol):
    name: str
    head: SubsetHead | None  # the drafting model's LM head cut to a draft vocabulary, if any
    mask: RoutingMask | None  # the self-drafter's routing mask (its passes cost what the layers it keeps cost)

    def unread(self, rows: Rows) -> int:
        """The columns its ``read`` would compute now (every row's tokens it has not read, padded to the longest
        unless it reads one row a pass): 0 for a drafter with no cache of its own to fill."""

    def read(self, rows: Rows) -> int:
        """Read what each active row committed and it has not read: the prompts before the first draft, everything
        since where decoding began plainly; a drafter with a cache keeps the logits after each row's newest token for
        its first draft. The passes that took."""

    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        """Up to ``limits[r]`` tokens after each active row ``r``: the argmax, or drawn with ``rng`` where sampling."""

    def commit(self, rows: Rows) -> None:
        """The active rows' sequences are committed: forget what was drafted off them."""

    def select(self, staying: torch.Tensor) -> None:
        """Only the rows ``staying`` go on decoding."""

    def tidy(self) -> None:
        """Compact its cache where that pays (``RaggedCache.compact_if_worth_it``)."""

    @property
    def compactions(self) -> int:
        """How often its cache was compacted."""


class _BatchModelDrafting:
    """Drafting with a causal LM for every row at once, one batched pass per drafted token; subclasses say which model
    runs on which cache (``_pass``). With ``head`` (a draft vocabulary) it proposes only the vocabulary's tokens, as
    the drafter of one sequence would (``model_drafts``): each row's proposal is the processed softmax over the
    vocabulary, so rejection sampling stays exact."""

    processors: RowProcessors
    confidence_threshold: float | None
    end_tokens: frozenset[int]
    head: SubsetHead | None

    def _pass(self, feeds: list[list[int]]) -> torch.Tensor:
        """Run every row's ``feeds``; the logits of each row's newest real column, ``[rows, vocab]``."""
        raise NotImplementedError

    def _drafted(self, rows: Rows, feeds: list[list[int]], limits: list[int], rng: RandomStream | None,
                 keep_drafting: KeepDraftingRows | None, first: torch.Tensor | None = None) -> BatchDraft:
        """Up to ``limits[r]`` tokens after row ``r``'s ``feeds`` (what it has not fed yet), one pass per column; the
        first column from ``first`` where a read already gave each row's logits after its newest token."""
        draft = BatchDraft.empty(len(feeds))
        drafting = [limit > 0 for limit in limits]
        while any(drafting):
            last = first if first is not None else self._pass(feeds)
            draft.forwards += int(first is None)
            first = None
            for i, row in enumerate(rows.active):
                if drafting[i]:
                    drafting[i] = self._next(row, last[i : i + 1], draft.rows[i], limits[i], rng, keep_drafting is None)
            if keep_drafting is not None and any(drafting):
                if not keep_drafting([row.confidences for row in draft.rows], drafting):
                    drafting = [False] * len(drafting)
            feeds = [row.tokens[-1:] if going_on else [] for row, going_on in zip(draft.rows, drafting)]
        return draft

    def _next(self, row: Row, logits: torch.Tensor, draft: Draft, limit: int, rng: RandomStream | None,
              stop_when_unsure: bool) -> bool:
        """Draft the row's next token from ``logits`` into ``draft``; whether the row may draft another (not after an
        end token or at its limit; with ``stop_when_unsure``, not after a token below the confidence threshold, as
        HF assisted generation: otherwise the planner decides for the batch)."""
        scores = self.processors(row.extended(draft.tokens), logits.float(), row.origin)
        chosen = drafted_token(scores, rng is not None, rng)
        if chosen is None:
            return False
        token, probs = chosen
        draft.tokens.append(token)
        draft.probs.append(probs)
        if rng is None:
            draft.second.append(second_choice(scores))
        if token in self.end_tokens or len(draft.tokens) >= limit:
            return False
        if not stop_when_unsure:
            return True
        return self.confidence_threshold is None or draft.confidences[-1] >= self.confidence_threshold


class BatchAssistant(_BatchModelDrafting):
    """An assistant model drafting for every row in one pass per token, on a ``RaggedCache`` of its own.

    ``fed[r]`` lists the tokens of row ``r`` the cache holds, in order: its committed tokens, then the
    drafts fed since. After a block, the drafts the row did not commit are forgotten
    (``RaggedCache.forget_last``); the newest committed token is always fed with the next draft. A read (the
    prompts before the first draft) feeds every row's newest token too and keeps the logits after it, which give
    the first draft token, as HF's assistant's prefill does: one pass per drafted token, the read included. Prompts of
    very different lengths are read one row a pass (``RaggedCache.reads_apart``), not padded to the longest.

    With ``context`` (``ViaSDConfig.drafter_context``) each row is read from at most that many of the tokens it has when first read, its attention sinks and the latest
    ones; the tokens between (``skipped[r]``) are never fed, and positions run on without them.
    """

    name = "assistant"
    mask = None

    def __init__(self, model: nn.Module, processors: RowProcessors, confidence_threshold: float | None,
                 end_tokens: frozenset[int], rows: int, device: torch.device, reader: Reader | None = None,
                 context: int | None = None, head: SubsetHead | None = None) -> None:
        self.model = model
        self.reader = reader  # the same model for long passes (a quantised copy's dequantised twin), if any
        self.processors = processors
        self.confidence_threshold = confidence_threshold
        self.end_tokens = end_tokens
        self.context = context
        self.head = head
        self.cache = RaggedCache(model.config, rows, device)
        self.fed: list[list[int]] = [[] for _ in range(rows)]
        self.skipped: list[slice | None] = [None] * rows  # each row's positions never fed, set when first read
        self.pending: torch.Tensor | None = None  # a read's logits after each row's newest token, for the first draft

    def _window(self, i: int, row: Row) -> slice:
        """The positions of row ``i`` this drafter skips: fixed when the row is first read."""
        skipped = self.skipped[i]
        return skipped if skipped is not None else unread_window(len(row.tokens()), self.context)

    def _seen(self, i: int, row: Row) -> list[int]:
        """Row ``i``'s tokens but those it skips: what this drafter's cache holds of it, in order."""
        tokens, skipped = row.tokens(), self._window(i, row)
        return tokens[: skipped.start] + tokens[skipped.stop :] if skipped.stop else tokens

    def unread(self, rows: Rows) -> int:
        unread = [max(len(self._seen(i, row)) - len(fed), 0) for i, (row, fed) in enumerate(zip(rows.active, self.fed))]
        return sum(unread) if self.cache.reads_apart(unread) else len(unread) * max(unread, default=0)

    @torch.no_grad()
    def read(self, rows: Rows) -> int:
        self.skipped = [self._window(i, row) for i, row in enumerate(rows.active)]
        feeds = [self._seen(i, row)[len(fed) :] for i, (row, fed) in enumerate(zip(rows.active, self.fed))]
        if not any(feeds):
            return 0
        for fed, feed in zip(self.fed, feeds):
            fed.extend(feed)
        if self.cache.reads_apart([len(feed) for feed in feeds]):
            models = [reading_model(self.model, self.reader, len(feed)) for feed in feeds]
            self.pending = self.cache.newest_apart(models, feeds, self.head)
            return len(feeds)
        tokens, real = right_padded(feeds, self.cache.mask.device)
        self.pending = self.cache.newest(reading_model(self.model, self.reader, tokens.numel()), tokens, real, self.head)
        return 1

    @torch.no_grad()
    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        """One pass per drafted token for all rows; the first also feeds what each row committed since its last (its
        window was fixed when it was read, which comes first)."""
        feeds = [self._seen(i, row)[len(fed) :] for i, (row, fed) in enumerate(zip(rows.active, self.fed))]
        first, self.pending = (self.pending if not any(feeds) else None), None
        return self._drafted(rows, feeds, limits, rng, keep_drafting, first)

    def _pass(self, feeds: list[list[int]]) -> torch.Tensor:
        """A block's first pass feeds every row what it committed since its last draft: through the reader where that
        is as many tokens as the reader runs faster."""
        tokens, real = right_padded(feeds, self.cache.mask.device)
        logits = self.cache.newest(reading_model(self.model, self.reader, tokens.numel()), tokens, real, self.head)
        for fed, feed in zip(self.fed, feeds):
            fed.extend(feed)
        return logits

    def commit(self, rows: Rows) -> None:
        self.pending = None
        forget = []
        for i, (row, fed) in enumerate(zip(rows.active, self.fed)):
            keep = kept_prefix(fed, self._seen(i, row))
            forget.append(len(fed) - keep)
            del fed[keep:]
        self.cache.forget_last(torch.tensor(forget, device=self.cache.mask.device))

    def select(self, staying: torch.Tensor) -> None:
        self.cache.select(staying.to(self.cache.mask.device))
        self.fed = [self.fed[i] for i in staying.tolist()]
        self.skipped = [self.skipped[i] for i in staying.tolist()]
        if self.pending is not None:
            self.pending = self.pending[staying.to(self.pending.device)]

    def tidy(self) -> None:
        self.cache.compact_if_worth_it()

    @property
    def compactions(self) -> int:
        return self.cache.compactions


class BatchSelfDrafter(_BatchModelDrafting):
    """The target itself under a heavier routing mask (``ViaSDConfig.self_draft_mask``), drafting for every row at once on the
    target's own ``RaggedCache``: its passes are provisional, so the cache is as before once the draft is made. It
    has nothing of its own to read, forget or compact: the decoder keeps the target's cache."""

    name = "self"
    compactions = 0

    def __init__(self, model: nn.Module, mask: RoutingMask, target: RaggedCache, processors: RowProcessors,
                 confidence_threshold: float | None, end_tokens: frozenset[int], head: SubsetHead | None = None) -> None:
        mask.validate_for(model)
        self.model = model
        self.mask = mask
        self.skipped = mask.skipped_layers
        self.target = target
        self.processors = processors
        self.confidence_threshold = confidence_threshold
        self.end_tokens = end_tokens
        self.head = head

    def unread(self, rows: Rows) -> int:
        return 0

    def read(self, rows: Rows) -> int:
        return 0

    @torch.no_grad()
    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        """The first pass feeds each row's committed tokens the target's cache lacks (its newest; in tiered mode also
        those the slim tier committed), then one pass per drafted token."""
        feeds = [row.unprocessed() for row in rows.active]
        with self.target.provisional(), skipping(self.model, self.skipped):
            return self._drafted(rows, feeds, limits, rng, keep_drafting)

    def _pass(self, feeds: list[list[int]]) -> torch.Tensor:
        tokens, real = right_padded(feeds, self.target.mask.device)
        return self.target.newest(self.model, tokens, real, self.head)

    def commit(self, rows: Rows) -> None:
        """Nothing to forget: the provisional writes were cropped when drafting ended."""

    def select(self, staying: torch.Tensor) -> None:
        """The decoder selects the target's cache."""

    def tidy(self) -> None:
        """The decoder compacts the target's cache."""


class BatchLookup:
    """Prompt lookup, row by row: each row copies from its own sequence (without its padding); nothing is cached."""

    name = "prompt_lookup"
    head = None
    mask = None

    def __init__(self, lookup: PromptLookupDrafter) -> None:
        self.lookup = lookup

    def unread(self, rows: Rows) -> int:
        return 0

    def read(self, rows: Rows) -> int:
        return 0

    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        return BatchDraft([self.lookup.draft(row.ids, limit, row.padding, row.origin) if limit > 0 else Draft([], [])
                           for row, limit in zip(rows.active, limits)])

    def commit(self, rows: Rows) -> None:
        """Stateless: each block reads the rows afresh."""

    def select(self, staying: torch.Tensor) -> None:
        """Stateless: nothing to select."""

    def tidy(self) -> None:
        """No cache to compact."""

    compactions = 0


class AroundAssistant:
    """A drafter around an assistant's drafter, which holds the only cache: it reads and commits the rows as
    ``assistant_rows`` gives them (the rows themselves, unless a subclass says else), and rows leave it, and it tidies
    and compacts, as the assistant does."""

    assistant: BatchDrafter

    def assistant_rows(self, rows: Rows) -> Rows:
        return rows

    def unread(self, rows: Rows) -> int:
        return self.assistant.unread(self.assistant_rows(rows))

    def read(self, rows: Rows) -> int:
        return self.assistant.read(self.assistant_rows(rows))

    def commit(self, rows: Rows) -> None:
        self.assistant.commit(self.assistant_rows(rows))

    def select(self, staying: torch.Tensor) -> None:
        self.assistant.select(staying)

    def tidy(self) -> None:
        self.assistant.tidy()

    @property
    def compactions(self) -> int:
        return self.assistant.compactions


class BatchHybrid(AroundAssistant):
    """Prompt lookup where a row's trailing n-gram occurred before, the assistant for the other rows; the assistant's
    passes run only when some row has nothing to copy (and then feed every row what it committed). With ``choice``
    (``hybrid_choice.CopyOrDraft``, fed by the decoder after each block) a block that could copy does so only while
    copying commits more per unit of cost; otherwise the assistant drafts every row."""

    name = "hybrid"
    mask = None

    def __init__(self, lookup: BatchLookup, assistant: BatchDrafter, choice: CopyOrDraft | None = None) -> None:
        self.lookup = lookup
        self.assistant = assistant
        self.choice = choice

    @property
    def head(self) -> SubsetHead | None:
        return self.assistant.head

    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        copied = self.lookup.draft(rows, limits, rng, keep_drafting)
        could_copy = any(copied.tokens)
        copies = could_copy and (self.choice is None or self.choice.copy())
        if not copies:
            copied = BatchDraft.empty(len(rows))
        model_limits = [0 if tokens else limit for tokens, limit in zip(copied.tokens, limits)]
        if not any(model_limits):
            return BatchDraft(copied.rows, copied=True)
        drafted = self.assistant.draft(rows, model_limits, rng, keep_drafting)
        return BatchDraft([copy if copy.tokens else own for copy, own in zip(copied.rows, drafted.rows)],
                          drafted.forwards, copied=copies if could_copy else None)
