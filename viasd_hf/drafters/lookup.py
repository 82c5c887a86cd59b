"""Drafters that copy: prompt lookup, and the hybrid that copies where copying has paid and runs a model elsewhere."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from viasd_hf.control.hybrid_choice import CopyOrDraft
from viasd_hf.drafters.protocol import Drafter, KeepDrafting, through_first_end
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.decisions import forbidden
from viasd_hf.engine.sampling import RandomStream


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
        logits_processor: LogitsProcessorList | None = None,
        vocab_size: int | None = None,
        max_ngram_size: int = 2,
        end_tokens: frozenset[int] = frozenset(),
    ) -> None:
        if logits_processor and vocab_size is None:
            raise ValueError("PromptLookupDrafter needs vocab_size to check its drafts against logits_processor")
        self.num_tokens = num_tokens
        self.logits_processor = logits_processor
        self.vocab_size = vocab_size
        self.max_ngram_size = max_ngram_size
        self.end_tokens = end_tokens

    def draft(
        self, ids: torch.Tensor, max_tokens: int, rng: RandomStream | None, keep_drafting: KeepDrafting | None = None
    ) -> Draft:
        """Copying costs nothing, so the whole continuation is proposed whatever ``keep_drafting`` would say."""
        tokens = ids[0].tolist()
        for size in range(min(self.max_ngram_size, len(tokens) - 1), 0, -1):
            tail = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == tail:
                    copied = tokens[start + size : start + size + min(self.num_tokens, max_tokens)]
                    proposal = self.allowed_prefix(ids, through_first_end(copied, self.end_tokens))
                    if proposal:
                        return Draft(tokens=proposal, probs=[None] * len(proposal))
        return Draft(tokens=[], probs=[])

    def allowed_prefix(self, ids: torch.Tensor, copied: list[int]) -> list[int]:
        """``copied`` cut before its first token that the logits processors forbid where it would go."""
        if not self.logits_processor:
            return copied
        equal_logits = torch.ones((1, self.vocab_size), device=ids.device)
        for i, token in enumerate(copied):
            prefix = torch.cat([ids, ids.new_tensor([copied[:i]])], dim=-1)
            if forbidden(self.logits_processor(prefix, equal_logits.clone()))[0, token]:
                return copied[:i]
        return copied

    def commit(self, ids: torch.Tensor) -> None:
        """Stateless: the lookup reads the committed sequence afresh each block."""

    def prefill(self, ids: torch.Tensor) -> int:
        """Nothing to process: the lookup reads the committed sequence afresh each block."""
        return 0


class HybridDrafter:
    """Prompt lookup when the trailing n-gram occurred before, else a model drafter.

    A lookup draft costs no forward pass, and where text is copied (summaries, RAG, code edits) it
    is long and mostly accepted; elsewhere the model drafts. With a ``choice``
    (``hybrid_choice.CopyOrDraft``), a match is copied only while copied blocks commit more per
    unit of cost than model-drafted ones. Each block is drafted wholly by one of them, chosen from
    the committed ids alone, so sampling stays exact: lookup drafts are deterministic (one-hot
    proposals) and model drafts carry their own distributions.
    """

    name = "hybrid"

    def __init__(self, lookup: PromptLookupDrafter, model_drafter: Drafter, choice: CopyOrDraft | None = None) -> None:
        self.lookup = lookup
        self.model_drafter = model_drafter
        self.choice = choice
        self._pending_block: tuple[bool, int, int] | None = None  # (copied, committed length, drafter passes)

    def draft(
        self, ids: torch.Tensor, max_tokens: int, rng: RandomStream | None, keep_drafting: KeepDrafting | None = None
    ) -> Draft:
        copied = self.lookup.draft(ids, max_tokens, rng)
        copies = bool(copied.tokens) and (self.choice is None or self.choice.copy())
        draft = copied if copies else self.model_drafter.draft(ids, max_tokens, rng, keep_drafting)
        self._pending_block = (copies, ids.shape[-1], draft.forwards)
        return draft

    def commit(self, ids: torch.Tensor) -> None:
        """Tell the choice what the last block committed; the model drafter catches up on (or crops away) the rest."""
        if self.choice is not None and self._pending_block is not None:
            copies, length, passes = self._pending_block
            self.choice.observe(copies, ids.shape[-1] - length, passes)
        self._pending_block = None
        self.model_drafter.commit(ids)

    def prefill(self, ids: torch.Tensor) -> int:
        return self.model_drafter.prefill(ids)


def model_drafter_of(drafter: Drafter) -> Drafter:
    """The drafter that runs a model: a hybrid's model drafter, else the drafter itself."""
    return drafter.model_drafter if isinstance(drafter, HybridDrafter) else drafter
