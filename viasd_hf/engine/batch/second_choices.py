"""The drafter's second choices, verified beside the draft in the same full pass.

Where the full model rejects a greedy draft, its own token is often the drafter's second choice at that position
(``bench/studies/runner_up``, ``bench/studies/draft_trees``). The chain of drafter passes that made the draft ranked
that choice already, so it costs no drafter pass to propose: only a column more in the verifying pass, whose cost
barely grows with its width on a CPU or a GPU. Each row's verifying pass therefore feeds, after its draft, the
drafter's second choice at each draft position, as a leaf of a tree: it takes the position of the draft token it is
an alternative to and sees what that token sees (``position_masks.beside_masks``). The full model walks the draft
as ever; where it replaces draft ``j`` by its own token and that token is the second choice fed beside draft ``j``,
the pass has scored what follows it too, so the block commits one token more: the full model's choice after it
(``kept_beside``). The kept choice's keys and values take the place of the draft it replaced in the target's cache
(``RaggedCache.move``), the other columns of the pass beyond it are forgotten. Every committed token is still the full
model's greedy choice after the tokens before it, so lossless greedy output stays ``generate``'s.

Greedy decoding only (a sampled block would need rejection sampling over several candidates), for models whose cache
holds every column fed and whose attention reads the masks as given (``verifies_beside``); blocks where the slim tier
repairs or decides run as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from viasd_hf.control.draft_planner import DraftPlanner
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.batch.position_masks import MASK_KINDS, attention_implementation
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.rows import Row
from viasd_hf.engine.kv_cache import full_attention_only
from viasd_hf.engine.policies import BlockResult
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.verifier import TierLogits


@dataclass
class Beside:
    """A second choice fed beside draft ``index`` of a row: its column and the draft's in the row's feed, and, after
    the pass, the full model's raw logits after it."""

    index: int
    column: int
    replaces: int
    logits: torch.Tensor | None = None


def verifies_beside(model: nn.Module, target: RaggedCache, greedy: bool) -> bool:
    """Whether this call may verify second choices beside its drafts (where the draft planner finds them worth a
    column, ``worth_verifying``): greedy decoding of a decoder-only model whose cache holds every column fed and whose
    attention reads a 4D mask as given."""
    return (greedy and target.encoder is None and full_attention_only(target.cache)
            and attention_implementation(model.config) in MASK_KINDS)


def worth_verifying(planner: DraftPlanner, drafts: list[Draft]) -> list[list[bool]]:
    """Which second choices of each row's draft its verifying pass feeds (``DraftPlanner.second_choices_worth``)."""
    return [planner.second_choices_worth(draft.confidences, draft.second_confidences) if draft.drawn else []
            for draft in drafts]


def fed_beside(committed: list[int], draft: Draft, worth: list[bool]) -> tuple[list[int], list[int], list[Beside]]:
    """A row's feed for a verifying pass with second choices: its unprocessed ``committed`` tokens, its draft, then the
    second choice at each draft position where it is ``worth`` a column; each column's ``stands_in`` (its own index,
    or for a second choice the draft token's it is an alternative to); and where the second choices are."""
    feed = committed + draft.tokens
    stands_in = list(range(len(feed)))
    beside = []
    for index, (token, fed) in enumerate(zip(draft.second[: len(draft.tokens)], worth)):
        if token is not None and fed:
            beside.append(Beside(index, len(feed), len(committed) + index))
            stands_in.append(len(committed) + index)
            feed.append(token)
    return feed, stands_in, beside


def kept_beside(block: BlockResult, draft: Draft, view: TierLogits, beside: list[Beside], row: Row,
                processors: RowProcessors) -> tuple[BlockResult, Beside | None]:
    """Where the full model replaced a draft by the second choice fed beside it, the block with one token more, the
    full model's choice after that second choice, and the second choice kept (else the block as it was, and None)."""
    index = block.kept
    if block.decided_by != "full" or index >= len(draft.tokens):
        return block, None
    kept = next((each for each in beside if each.index == index and draft.second[index] == block.tokens[index]), None)
    if kept is None:
        return block, None
    raw = kept.logits[None].float()
    scores = processors(row.extended(block.tokens[: index + 1]), raw, row.origin)
    rows = TierLogits(torch.cat([view.logits[: index + 1], raw]), torch.cat([view.scores[: index + 1], scores]),
                      seconds=view.seconds, fed=view.fed)
    return replace(block, tokens=[*block.tokens, int(scores.argmax(-1))], made_by=[*block.made_by, "full"],
                   rows=rows, second_choice_kept=True), kept


def kept_second_choices(blocks: list[BlockResult], views: list[TierLogits], drafts: list[Draft],
                        beside: list[list[Beside]], rows: list[Row], processors: RowProcessors, target: RaggedCache,
                        planner: DraftPlanner) -> list[BlockResult]:
    """Each row's block with the second choice the full model kept, if any, and the token after it (``kept_beside``);
    a kept choice's keys and values take the place of the draft it replaced in the target's cache. The planner learns
    from each rejected draft whether its second choice was the full model's token."""
    first = target.columns - max(view.fed for view in views)  # the pass's first column
    moved: tuple[list[int], list[int], list[int]] = ([], [], [])
    for i, (row, view) in enumerate(zip(rows, views)):
        row.stats.second_choices += len(beside[i])
        observe_second_choice(planner, blocks[i], drafts[i])
        blocks[i], kept = kept_beside(blocks[i], drafts[i], view, beside[i], row, processors)
        if kept is not None:
            for values, value in zip(moved, (i, first + kept.column, first + kept.replaces)):
                values.append(value)
    target.move(*moved)
    return blocks


def observe_second_choice(planner: DraftPlanner, block: BlockResult, draft: Draft) -> None:
    """Where the full model rejected a drawn draft that had a second choice, whether its token was that choice."""
    index = block.kept
    if block.decided_by != "full" or index >= len(draft.tokens) or index >= len(draft.second) or not draft.drawn:
        return
    second = draft.second_confidences[index]
    if second is not None:
        planner.observe_second(draft.confidences[index], second, draft.second[index] == block.tokens[index])
