"""A drafter of another tokenizer for a batch: ``BatchAssistant`` on each row's text in its own tokens, its drafts
handed over in the target's (``drafters.translation``).

The assistant keeps its ragged cache as for a drafter of the target's tokenizer; what it reads of a row is the
row's committed text re-encoded with its tokenizer (``Translation.context``), so after each block it keeps the
common prefix of what it had fed and the new context (``BatchAssistant.commit``) and feeds the rest with its next
draft: where the target kept the drafted text, that is its newest token; where re-encoding changed the tail, a few.

It drafts greedily, in its own tokens, without the target's logits processors (they score the target's tokens;
verifying applies them). The translated tokens carry no distribution over the target's vocabulary, so they are
proposals of one token each, as prompt lookup's copies are: the target keeps them greedily, or, sampling, by
rejection sampling against a point proposal (keep the token with the target's probability of it, else draw from
the rest), which is exact for any proposal, however it was made. HF's universal assisted generation is greedy only;
for sampling HF drafts over the tokens the two vocabularies share instead (``UniversalSpeculativeDecodingGenerator``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from viasd_hf.config import ViaSDConfig
from viasd_hf.drafters.translation import Translation
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.batch.drafting import (
    AroundAssistant,
    BatchAssistant,
    BatchDraft,
    BatchDrafter,
    BatchHybrid,
    BatchLookup,
    KeepDraftingRows,
)
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.batch.model_drafts import Reader
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.rows import Row, Rows
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream


@dataclass
class AssistantRows:
    """The active rows as the assistant reads them (``Rows.active``'s order): each one's context in its tokens."""

    active: list[Row]


class TranslatingDrafter(AroundAssistant):
    """``BatchDrafter`` for an assistant of another tokenizer: it reads and drafts on each row's context in its own
    tokens, and proposes the target's tokens of the text it drafted."""

    name = "translating"
    mask = None
    head = None  # a draft vocabulary is the target's tokens: the assistant drafts over its own

    def __init__(self, assistant: BatchAssistant, translation: Translation) -> None:
        self.assistant = assistant
        self.translation = translation
        self.contexts: dict[int, tuple[int, list[int]]] = {}  # by row origin: its length when re-encoded, the context

    def context(self, row: Row) -> list[int]:
        """The row's committed text in the assistant's tokens, re-encoded once for each length the row reaches."""
        length, context = self.contexts.get(row.origin, (-1, []))
        if length != row.length:
            context = self.translation.context(row.tokens())
            self.contexts[row.origin] = (row.length, context)
        return context

    def assistant_rows(self, rows: Rows) -> AssistantRows:
        return AssistantRows([Row(row.origin, torch.tensor([self.context(row)]), 0, row.stats) for row in rows.active])

    def draft(self, rows: Rows, limits: list[int], rng: RandomStream | None,
              keep_drafting: KeepDraftingRows | None) -> BatchDraft:
        """Each row's greedy draft of up to its limit in the assistant's tokens, translated and cut to the limit
        (a token of one may write more tokens of the other); ``rng`` is unused: point proposals stay exact."""
        drafted = self.assistant.draft(self.assistant_rows(rows), limits, None, keep_drafting)
        translated = [self.translation.draft(row.tokens(), self.context(row), tokens)[:limit]
                      for row, tokens, limit in zip(rows.active, drafted.tokens, limits)]
        return BatchDraft([Draft(tokens, [None] * len(tokens)) for tokens in translated], drafted.forwards)


def translating_drafter(drafter: nn.Module, translation: Translation, lookup: PromptLookupDrafter | None,
                        config: ViaSDConfig, target: RaggedCache, reader: Reader | None) -> BatchDrafter:
    """The assistant of another tokenizer (reading prompts through ``reader`` where there is one), with prompt lookup
    where ``lookup`` copies, as ``batch_drafter`` pairs them. It stops at its own special tokens
    (``Translation.drafter_ends``) and below the confidence threshold in its own tokens."""
    rows, device = target.mask.shape[0], target.mask.device
    assistant = BatchAssistant(drafter, RowProcessors(), config.knobs.draft_confidence_threshold,
                               translation.drafter_ends, rows, device, reader, config.drafter_context)
    translating = TranslatingDrafter(assistant, translation)
    return translating if lookup is None else BatchHybrid(BatchLookup(lookup), translating)
