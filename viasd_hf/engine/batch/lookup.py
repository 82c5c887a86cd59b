"""Prompt lookup: a drafter that copies from the sequence itself."""

from __future__ import annotations

import torch

from viasd_hf.engine.accept import Draft
from viasd_hf.engine.decisions import forbidden
from viasd_hf.engine.processors import RowProcessors


class PromptLookupDrafter:
    """Prompt lookup decoding: find the latest earlier occurrence of the trailing n-gram and copy what followed.

    As in transformers, a copied continuation is cut before the first token the logits processors
    forbid there (``no_repeat_ngram_size`` forbids exactly what a lookup copies), found by running
    them on a row of equal logits; if nothing is left, an earlier occurrence is tried. It is also cut
    after its first end token (EOS): nothing after it could be committed.
    """

    name = "prompt_lookup"

    def __init__(
        self,
        num_tokens: int,
        processors: RowProcessors | None = None,
        vocab_size: int | None = None,
        max_ngram_size: int = 2,
        end_tokens: frozenset[int] = frozenset(),
    ) -> None:
        if processors and vocab_size is None:
            raise ValueError("PromptLookupDrafter needs vocab_size to check its drafts against the logits processors")
        self.num_tokens = num_tokens
        self.processors = processors
        self.vocab_size = vocab_size
        self.max_ngram_size = max_ngram_size
        self.end_tokens = end_tokens

    def draft(self, ids: torch.Tensor, max_tokens: int, padding: int = 0, origin: int = 0) -> Draft:
        """Up to ``max_tokens`` tokens copied after ``ids`` (``[1, length]``, of which the first ``padding`` are left
        padding, never copied; ``origin``: the row's index in the call's batch): copying costs nothing, so the whole
        continuation is proposed, whatever a draft planner would say of its length."""
        tokens = ids[0, padding:].tolist()
        for size in range(min(self.max_ngram_size, len(tokens) - 1), 0, -1):
            tail = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == tail:
                    copied = tokens[start + size : start + size + min(self.num_tokens, max_tokens)]
                    proposal = self.allowed_prefix(ids, through_first_end(copied, self.end_tokens), origin)
                    if proposal:
                        return Draft(tokens=proposal, probs=[None] * len(proposal))
        return Draft(tokens=[], probs=[])

    def allowed_prefix(self, ids: torch.Tensor, copied: list[int], origin: int = 0) -> list[int]:
        """``copied`` cut before its first token that the logits processors forbid where it would go."""
        if not self.processors:
            return copied
        equal_logits = torch.ones((1, self.vocab_size), device=ids.device)
        for i, token in enumerate(copied):
            prefix = torch.cat([ids, ids.new_tensor([copied[:i]])], dim=-1)
            if forbidden(self.processors(prefix, equal_logits.clone(), origin))[0, token]:
                return copied[:i]
        return copied


def through_first_end(tokens: list[int], end_tokens: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first of ``end_tokens``."""
    for i, token in enumerate(tokens):
        if token in end_tokens:
            return tokens[: i + 1]
    return tokens
