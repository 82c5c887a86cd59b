"""Drafters: whatever proposes the next few tokens, behind one small protocol.

- ``AssistantDrafter``: a smaller model sharing the target's tokenizer, with its own KV cache
  cropped back to the committed prefix after each block.
- ``SelfDrafter``: the target routed with a heavier mask; it reads the full model's committed
  KV cache and crops its provisional writes away, so it costs no memory or extra weights.
- ``PromptLookupDrafter``: copies the continuation of the last n-gram's earlier occurrence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from transformers import LogitsProcessorList

from .cache import crop_to, new_cache
from .masks import RoutingMask
from .routing import skipping
from .sampling import RandomStream, sample
from .tiers import forbidden

if TYPE_CHECKING:
    from .decoding import DecodingState


@dataclass
class Draft:
    """Proposed tokens, and the processed distribution each was drawn from (``None`` when not a model)."""

    tokens: list[int]
    probs: list[torch.Tensor | None]


class Drafter(Protocol):
    name: str
    forwards: int
    seconds: float

    def draft(self, state: DecodingState, max_tokens: int, rng: RandomStream | None) -> Draft:
        """Up to ``max_tokens`` tokens; a sampling drafter draws them from the call's ``rng`` (``None`` when greedy)."""

    def commit(self, state: DecodingState) -> None:
        """Forget whatever the drafter processed that is no longer on the committed sequence."""


class _ModelDrafter:
    """Drafting with a causal LM (greedy, or sampling from the processed distribution); subclasses say
    which model runs and on which cache."""

    name = "model"

    def __init__(
        self, logits_processor: LogitsProcessorList, confidence_threshold: float | None, do_sample: bool = False
    ) -> None:
        self.logits_processor = logits_processor
        self.confidence_threshold = confidence_threshold
        self.do_sample = do_sample
        self.forwards = 0
        self.seconds = 0.0

    def _forward(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _pending(self, state: DecodingState) -> torch.Tensor:
        raise NotImplementedError

    def _finish(self, state: DecodingState, drafted: int) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def draft(self, state: DecodingState, max_tokens: int, rng: RandomStream | None) -> Draft:
        started = time.perf_counter()
        sequence = state.ids
        feed = self._pending(state)
        draft = Draft(tokens=[], probs=[])
        while len(draft.tokens) < max_tokens:
            logits = self._forward(state, feed)[-1:].float()
            self.forwards += 1
            scores = self.logits_processor(sequence, logits)
            probs = scores.softmax(-1)[0]
            token = sample(probs, rng) if self.do_sample else int(scores.argmax(-1))
            draft.tokens.append(token)
            draft.probs.append(probs)
            feed = torch.tensor([[token]], device=sequence.device)
            sequence = torch.cat([sequence, feed], dim=-1)
            if self.confidence_threshold is not None and probs[token].item() < self.confidence_threshold:
                break
        self._finish(state, len(draft.tokens))
        self.seconds += time.perf_counter() - started
        return draft


class AssistantDrafter(_ModelDrafter):
    """A separate (smaller) model with the target's tokenizer and a KV cache of its own."""

    name = "assistant"

    def __init__(
        self,
        model: nn.Module,
        logits_processor: LogitsProcessorList,
        confidence_threshold: float | None,
        do_sample: bool = False,
    ) -> None:
        super().__init__(logits_processor, confidence_threshold, do_sample)
        self.model = model
        self.cache = new_cache(model.config)
        self.processed: list[int] = []

    def _pending(self, state: DecodingState) -> torch.Tensor:
        return state.ids[:, len(self.processed) :]

    def _forward(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        logits = state.forward(self.model, tokens, len(self.processed), self.cache, keep=1)
        self.processed.extend(tokens[0].tolist())
        return logits

    def _finish(self, state: DecodingState, drafted: int) -> None:
        """The last drafted token was never fed; everything else stays until ``commit``."""

    def commit(self, state: DecodingState) -> None:
        committed = state.ids[0].tolist()
        keep = 0
        for mine, theirs in zip(self.processed, committed):
            if mine != theirs:
                break
            keep += 1
        keep = min(keep, len(committed) - 1)  # the newest committed token is fed with the next draft
        crop_to(self.cache, keep)
        del self.processed[keep:]


class SelfDrafter(_ModelDrafter):
    """The target itself under a heavier routing mask, reading the full model's committed cache."""

    name = "self"

    def __init__(
        self,
        model: nn.Module,
        mask: RoutingMask,
        logits_processor: LogitsProcessorList,
        confidence_threshold: float | None,
        do_sample: bool = False,
    ) -> None:
        super().__init__(logits_processor, confidence_threshold, do_sample)
        mask.validate_for(model)
        self.model = model
        self.mask = mask
        self.skipped = mask.skipped_layers  # validated once here, not on every drafting pass
        self._fed = 0

    def _pending(self, state: DecodingState) -> torch.Tensor:
        self._fed = state.full_length
        return state.ids[:, state.full_length :]

    def _forward(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        with skipping(self.model, self.skipped):
            logits = state.forward(self.model, tokens, self._fed, state.full_cache, keep=1)
        self._fed += tokens.shape[1]
        return logits

    def _finish(self, state: DecodingState, drafted: int) -> None:
        crop_to(state.full_cache, state.full_length)

    def commit(self, state: DecodingState) -> None:
        """Nothing to forget: every draft's cache writes were cropped when drafting ended."""


class PromptLookupDrafter:
    """Prompt lookup decoding: find the latest earlier occurrence of the trailing n-gram and copy what followed.

    As in transformers, a copied continuation is cut before the first token the logits processors
    forbid there (``no_repeat_ngram_size`` forbids exactly what a lookup copies), found by running
    them on a row of equal logits; if nothing is left, an earlier occurrence is tried.
    """

    name = "prompt_lookup"

    def __init__(
        self,
        num_tokens: int,
        logits_processor: LogitsProcessorList | None = None,
        vocab_size: int | None = None,
        max_ngram_size: int = 2,
    ) -> None:
        if logits_processor and vocab_size is None:
            raise ValueError("PromptLookupDrafter needs vocab_size to check its drafts against logits_processor")
        self.num_tokens = num_tokens
        self.logits_processor = logits_processor
        self.vocab_size = vocab_size
        self.max_ngram_size = max_ngram_size
        self.forwards = 0
        self.seconds = 0.0

    def draft(self, state: DecodingState, max_tokens: int, rng: RandomStream | None) -> Draft:
        started = time.perf_counter()
        tokens = state.ids[0].tolist()
        proposal: list[int] = []
        for size in range(min(self.max_ngram_size, len(tokens) - 1), 0, -1):
            tail = tokens[-size:]
            for start in range(len(tokens) - size - 1, -1, -1):
                if tokens[start : start + size] == tail:
                    copied = tokens[start + size : start + size + min(self.num_tokens, max_tokens)]
                    proposal = self.allowed_prefix(state.ids, copied)
                    if proposal:
                        break
            if proposal:
                break
        self.seconds += time.perf_counter() - started
        return Draft(tokens=proposal, probs=[None] * len(proposal))

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

    def commit(self, state: DecodingState) -> None:
        """Stateless: the lookup reads the committed sequence afresh each block."""
