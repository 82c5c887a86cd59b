"""The call's logits processors, applied to one row of the batch as ``generate`` applies them to the whole batch.

``generate`` builds its processors for the batch it decodes, and some hold one entry per row:
``repetition_penalty``'s ``prompt_ignore_length``, ``encoder_repetition_penalty``'s encoder ids,
``prefix_allowed_tokens_fn``'s batch index. Such a processor accepts the whole batch and nothing
narrower, and reads row ``i``'s entry for row ``i``. VIA-SD scores each row on its own (its committed
tokens and drafts differ in length from the other rows'), so ``RowProcessors`` processes a row in its
own place of a batch of the call's size whose other places hold copies of it, and reads its place
back: every processor sees the row where ``generate`` would show it, with the row's own entries.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList


class RowProcessors:
    """``generate``'s logits processors for a batch of ``batch_size`` rows, applied to one row (``origin``: its index
    in that batch)."""

    def __init__(self, processors: LogitsProcessorList | None = None, batch_size: int = 1) -> None:
        self.processors = processors if processors is not None else LogitsProcessorList()
        self.batch_size = batch_size

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, origin: int = 0) -> torch.Tensor:
        """Row ``origin``'s ``scores`` (``[1, vocab]``) processed after its sequence ``ids`` (``[1, length]``, its left
        padding included, as ``generate`` holds it)."""
        if self.batch_size == 1:
            return self.processors(ids, scores)
        whole = self.processors(ids.expand(self.batch_size, -1), scores.expand(self.batch_size, -1).clone())
        return whole[origin : origin + 1]

    def positions(self, ids: torch.Tensor, draft: list[int], logits: torch.Tensor, origin: int = 0) -> torch.Tensor:
        """Each position's scores (``logits``: ``[len(draft) + 1, vocab]``) as ``generate`` would process them after
        the committed ``ids`` (``[1, length]``) and the drafts before it."""
        rows = []
        for i in range(len(draft) + 1):
            prefix = torch.cat([ids, ids.new_tensor([draft[:i]])], dim=-1)
            rows.append(self(prefix, logits[i : i + 1].float(), origin))
        return torch.cat(rows, dim=0)
