"""The rows of a batched call: each prompt's committed sequence, whether it still decodes, and the output.

A row is one prompt as ``generate`` holds it: its left padding, its prompt and the tokens committed
after it. Rows advance at their own pace (each keeps its own number of drafts per block), and each
stops on its own, as ``generate`` stops each row: when a stopping criterion (EOS, max length, stop
strings) says so for that row. The output pads the rows that stopped early with ``pad_token_id``,
as ``generate`` does once a row has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from viasd_hf.engine.policies import BlockResult
from viasd_hf.engine.stats import ViaSDStats


@dataclass
class Row:
    """One prompt's sequence (``ids``, ``[1, length]``, its left padding included) and what decoding it did."""

    origin: int  # its index in the batch ``generate`` was given
    ids: torch.Tensor
    padding: int
    stats: ViaSDStats
    finished: bool = False
    unverified: int = 0  # tiered mode: tokens committed on the slim tier's authority since the full model's last pass
    scores: list[torch.Tensor] = field(default_factory=list)  # output_scores: one (1, vocab) per new token, processed
    logits: list[torch.Tensor] = field(default_factory=list)  # output_logits: raw, from the tier that chose the token

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def new_tokens(self) -> int:
        return self.stats.new_tokens

    def tokens(self) -> list[int]:
        """The row's own sequence, without its padding: what its drafters read."""
        return self.ids[0, self.padding :].tolist()

    def unprocessed(self) -> list[int]:
        """The committed tokens the target's cache lacks, which its next pass feeds before a draft: the newest, and in
        tiered mode the tokens the slim tier committed since the full model's last pass."""
        return self.ids[0, self.length - 1 - self.unverified :].tolist()

    def extended(self, tokens: list[int]) -> torch.Tensor:
        """``ids`` followed by ``tokens`` (drafts not yet committed): what logits processors see before the next one."""
        return torch.cat([self.ids, self.ids.new_tensor([tokens])], dim=-1) if tokens else self.ids


class Rows:
    """The rows still decoding (``active``, in the order of the batch's tensors) and those that finished."""

    def __init__(
        self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, stopping_criteria: StoppingCriteriaList, max_length: int,
        keep_scores: bool = False, keep_logits: bool = False, streamer: BaseStreamer | None = None,
    ) -> None:
        padding = (prompt_mask == 0).sum(-1).tolist()
        self.active = [Row(i, input_ids[i : i + 1], padding[i], ViaSDStats()) for i in range(input_ids.shape[0])]
        self.finished: list[Row] = []
        self.stopping_criteria = stopping_criteria
        self.max_length = max_length
        self.keep_scores = keep_scores
        self.keep_logits = keep_logits
        self.streamer = streamer  # one row: its prompt, then each token as it is committed, as ``generate`` streams
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def __len__(self) -> int:
        return len(self.active)

    def commit(self, row: Row, block: BlockResult) -> int:
        """Append a block's tokens to ``row`` one at a time, stopping where its stopping criteria say; how many it took."""
        for count, (token, maker) in enumerate(zip(block.tokens, block.made_by), start=1):
            row.ids = torch.cat([row.ids, row.ids.new_tensor([[token]])], dim=-1)
            row.stats.record_commit(maker)
            if self.streamer is not None:
                self.streamer.put(row.ids[:, -1:].cpu())
            if self.keep_scores:  # row ``count - 1`` of the block's pass chose the token
                row.scores.append(block.rows.scores[count - 1 : count])
            if self.keep_logits:
                row.logits.append(block.rows.logits[count - 1 : count])
            if self.should_stop(row):
                row.finished = True
                return count
        return len(block.tokens)

    def should_stop(self, row: Row) -> bool:
        """Max length or a stopping criterion, asked of this row alone, as ``generate`` asks them row by row; criteria
        get the row's scores as ``generate`` passes them (each new token's, where ``output_scores`` keeps them)."""
        scores = tuple(row.scores) if self.keep_scores else None
        return row.length >= self.max_length or bool(self.stopping_criteria(row.ids, scores).any())

    def leave(self) -> list[Row]:
        """Move the finished rows out of ``active``; the rows that left, in their order there."""
        left = [row for row in self.active if row.finished]
        self.active = [row for row in self.active if not row.finished]
        self.finished.extend(left)
        return left

    def staying(self) -> torch.Tensor:
        """Positions in the batch's tensors of the rows still active, before ``leave`` (for ``index_select``)."""
        return torch.tensor([i for i, row in enumerate(self.active) if not row.finished], dtype=torch.long)

    def every_row(self) -> list[Row]:
        """All rows in the order of the batch ``generate`` was given."""
        return sorted(self.active + self.finished, key=lambda row: row.origin)

    def sequences(self, pad_token_id: int | None) -> torch.Tensor:
        """The output: every row's sequence, the shorter ones padded at the end with ``pad_token_id``."""
        rows = self.every_row()
        longest = max(row.length for row in rows)
        if pad_token_id is None and any(row.length < longest for row in rows):
            raise ValueError("rows finished at different lengths and there is no pad_token_id to pad them with; "
                             "set pad_token_id (generate sets it to eos_token_id when that is set)")
        out = rows[0].ids.new_full((len(rows), longest), pad_token_id if pad_token_id is not None else 0)
        for i, row in enumerate(rows):
            out[i, : row.length] = row.ids[0]
        return out

    def per_step(self, kept: str, pad_token_id: int | None) -> tuple[torch.Tensor, ...]:
        """Every row's kept ``scores`` or ``logits`` as ``generate`` returns them for a batch: one ``[rows, vocab]``
        tensor per new token of the longest row. After a row finished, its entries put all mass on ``pad_token_id``
        (0 there, −inf elsewhere): its output is padding from then on, chosen by no model. (``generate`` goes on
        scoring a finished row's padding instead; those scores choose nothing either.)"""
        rows = self.every_row()
        kept_per_row = [getattr(row, kept) for row in rows]
        steps = max(len(per_row) for per_row in kept_per_row)
        if not steps:
            return ()
        first = next(per_row[0] for per_row in kept_per_row if per_row)
        padding = torch.full_like(first, -float("inf"))
        if pad_token_id is not None:
            padding[0, pad_token_id] = 0.0
        return tuple(torch.cat([per_row[step] if step < len(per_row) else padding for per_row in kept_per_row])
                     for step in range(steps))
