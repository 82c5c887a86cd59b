"""Acceptance per row: each row of a batched pass is verified on its own, by the rules of ``engine.policies``.

A batched verifying pass returns logits ``[rows, columns, vocab]``. Row ``r`` fed its unprocessed
committed tokens (its newest; in tiered mode also those the slim tier committed since the full
model's last pass) and then its draft, so the ``len(draft) + 1`` columns from its newest committed
token on score the draft (``row_view`` is handed them): column ``j`` of them says what follows the
committed tokens and ``draft[:j]``. Each row then walks its own draft
as a lossless block of one sequence does (``policies.lossless``, whose steps these are), greedily
or, where sampling, by rejection sampling against the distributions its draft was drawn from: the slim
verifier may repair one draft, dropping those after it (``policies.slim_repair``); the full model
keeps the longest prefix it agrees with and adds its own token. So rows keep different numbers of
drafts in one block (ragged acceptance), and every committed token is the full model's own choice.
"""

from __future__ import annotations

import torch
from torch import nn

from viasd_hf.engine.accept import Draft, accept_prefix
from viasd_hf.engine.batch.ragged_cache import RaggedCache, right_padded
from viasd_hf.engine.batch.rows import Row, Rows
from viasd_hf.engine.batch.second_choices import Beside, fed_beside
from viasd_hf.engine.clock import Clock
from viasd_hf.engine.policies import (
    BlockResult,
    SlimRepair,
    VerificationRules,
    after_repair,
    decided,
)
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.verifier import TierLogits
from viasd_hf.masks.layer_skipping import skipping


def row_view(logits: torch.Tensor, row: Row, draft: list[int], processors: RowProcessors, seconds: float,
             fed: int) -> TierLogits:
    """What one row of a batched pass (``logits``: that row's ``[columns, vocab]``) says about its draft."""
    raw = logits[: len(draft) + 1].float()
    return TierLogits(raw, processors.positions(row.ids, draft, raw, row.origin), seconds=seconds, fed=fed)


def full_verdict(rules: VerificationRules, view: TierLogits, draft: Draft, repair: SlimRepair | None,
                 slim_view: TierLogits | None) -> BlockResult:
    """The full model's verdict on one row's (repaired) draft, as the row's block result:
    the prefix it keeps, greedily or by rejection sampling against the proposals the draft carries."""
    verified = repair.verified if repair is not None else draft
    block = decided(verified, accept_prefix(verified, rules.full(view)), view, "full")
    if slim_view is None or repair is None:
        return block
    return after_repair(block, slim_view, draft, repair)


def ragged(blocks: list[BlockResult]) -> bool:
    """Whether the rows of one block kept different numbers of drafts."""
    return len({block.kept for block in blocks}) > 1


def scored(model: nn.Module, target: RaggedCache, rows: Rows, drafts: list[list[int]], skipped: list[int] | None,
           processors: RowProcessors, clock: Clock) -> list[TierLogits]:
    """One pass of the target over each row's unprocessed committed tokens and draft (with ``skipped`` layers: the
    slim verifier, its pass provisional): what each row's pass says about its draft (``row_view``)."""
    feeds = [row.unprocessed() + tokens for row, tokens in zip(rows.active, drafts)]
    tokens, real = right_padded(feeds, target.mask.device)
    started = clock.now()
    if skipped is not None:
        with target.provisional(), skipping(model, skipped):
            logits = target.run(model, tokens, real, keep=tokens.shape[1])
    else:
        logits = target.run(model, tokens, real, keep=tokens.shape[1])
    seconds = clock.since(started)
    return [row_view(logits[i, len(feed) - len(draft) - 1 :], row, draft, processors, seconds, len(feed))
            for i, (row, feed, draft) in enumerate(zip(rows.active, feeds, drafts))]


def scored_beside(model: nn.Module, target: RaggedCache, rows: Rows, drafts: list[Draft], worth: list[list[bool]],
                  processors: RowProcessors, clock: Clock) -> tuple[list[TierLogits], list[list[Beside]]]:
    """The full model's pass over each row's unprocessed committed tokens, draft and, beside it, the drafter's second
    choices ``worth`` a column (``second_choices``): what each row's pass says about its draft, and its second choices
    with the logits after each."""
    fed = [fed_beside(row.unprocessed(), draft, row_worth) for row, draft, row_worth in zip(rows.active, drafts, worth)]
    tokens, real = right_padded([feed for feed, _, _ in fed], target.mask.device)
    stands_in = torch.arange(tokens.shape[1], device=tokens.device).repeat(len(fed), 1)
    for i, (_, stands, _) in enumerate(fed):
        stands_in[i, : len(stands)] = torch.tensor(stands, device=tokens.device)
    started = clock.now()
    logits = target.run(model, tokens, real, keep=tokens.shape[1], stands_in=stands_in)
    seconds = clock.since(started)
    views = []
    for i, (row, draft, (feed, _, beside)) in enumerate(zip(rows.active, drafts, fed)):
        first = len(feed) - len(beside) - len(draft.tokens) - 1  # the newest committed token's column
        views.append(row_view(logits[i, first:], row, draft.tokens, processors, seconds, len(feed)))
        for each in beside:
            each.logits = logits[i, each.column]
    return views, [beside for _, _, beside in fed]
