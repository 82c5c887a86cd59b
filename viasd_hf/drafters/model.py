"""Drafters that run a model: a smaller assistant with its own KV cache, or the target itself, routed."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LogitsProcessorList

from viasd_hf.drafters.protocol import KeepDrafting
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.decisions import forbidden
from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.engine.sampling import RandomStream, sample
from viasd_hf.engine.state import ModelInputs, TargetCache
from viasd_hf.masks.layer_skipping import skipping
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.vocabulary.head import SubsetHead

ATTENTION_SINK_TOKENS = 4  # prompt tokens a windowed drafter always keeps (Xiao et al., "Efficient Streaming LMs")


def drafted_token(scores: torch.Tensor, do_sample: bool, rng: RandomStream | None) -> tuple[int, torch.Tensor] | None:
    """The token drafted from processed ``scores`` (``[1, vocab]``), the argmax or a sample, and the distribution it
    was drawn from; ``None`` where the logits processors allow no token (the draft ends there)."""
    if forbidden(scores).all():
        return None
    probs = scores.softmax(-1)[0]
    return (sample(probs, rng) if do_sample else int(scores.argmax(-1))), probs


def kept_prefix(processed: list[int], committed: list[int]) -> int:
    """How many of the tokens a drafter's cache holds (``processed``, in order) it keeps after a block: those up to the
    first that differs from the ``committed`` sequence, but never the newest committed token, which is fed with the
    next draft."""
    keep = next((i for i, (mine, theirs) in enumerate(zip(processed, committed)) if mine != theirs), len(processed))
    return min(keep, len(committed) - 1)


class _ModelDrafter:
    """Drafting with a causal LM, greedy or sampling from the processed distribution; it stops early once
    unsure (``confidence_threshold``, as HF assisted generation). Subclasses say which model runs on which cache.

    With ``head`` (a draft vocabulary's sliced LM head) it proposes only the vocabulary's tokens: each
    proposal is the processed softmax over the vocabulary, zero elsewhere, and that is the distribution
    handed to the verifiers, so rejection sampling stays exact. It stops drafting where the logits
    processors allow no token of the vocabulary, and after one of ``end_tokens`` (the EOS tokens): nothing
    drafted after the end of generation could be committed. Where to stop depends only on the drafts
    already made, so sampling stays exact.
    """

    name = "model"

    def __init__(
        self,
        logits_processor: LogitsProcessorList,
        confidence_threshold: float | None,
        do_sample: bool = False,
        head: SubsetHead | None = None,
        end_tokens: frozenset[int] = frozenset(),
    ) -> None:
        self.logits_processor = logits_processor
        self.confidence_threshold = confidence_threshold
        self.do_sample = do_sample
        self.head = head
        self.end_tokens = end_tokens
        self._opening: torch.Tensor | None = None  # logits after the prefilled prompt: the first draft's first token

    def _drafting(self) -> AbstractContextManager:
        """What holds while a draft is made (the self-drafter's routing and provisional cache writes)."""
        return nullcontext()

    def _pending(self, ids: torch.Tensor) -> torch.Tensor:
        """The committed tokens this drafter's cache lacks; the next pass feeds them first."""
        raise NotImplementedError

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last of ``tokens``, fed after what was fed before."""
        raise NotImplementedError

    @torch.no_grad()
    def draft(
        self, ids: torch.Tensor, max_tokens: int, rng: RandomStream | None, keep_drafting: KeepDrafting | None = None
    ) -> Draft:
        sequence, feed = ids, self._pending(ids)
        draft = Draft(tokens=[], probs=[])
        confidences: list[float] = []
        stop_when_unsure = keep_drafting is None and self.confidence_threshold is not None
        with self._drafting():
            while len(draft.tokens) < max_tokens and (keep_drafting is None or keep_drafting(confidences)):
                if self._opening is not None and not feed.shape[1]:
                    logits, self._opening = self._opening, None
                else:
                    logits = self._forward(feed)[-1:]
                    draft.forwards += 1
                chosen = drafted_token(self.logits_processor(sequence, logits.float()), self.do_sample, rng)
                if chosen is None:
                    break
                token, probs = chosen
                draft.tokens.append(token)
                draft.probs.append(probs)
                confidences.append(probs[token].item())
                feed = torch.tensor([[token]], device=sequence.device)
                sequence = torch.cat([sequence, feed], dim=-1)
                if token in self.end_tokens or (stop_when_unsure and confidences[-1] < self.confidence_threshold):
                    break
        return draft


def unread_window(length: int, context: int | None) -> slice:
    """The positions a drafter that reads at most ``context`` of a sequence's first ``length`` tokens never feeds:
    those between the first ``ATTENTION_SINK_TOKENS`` and the latest ones (the last is always read); none where the
    whole sequence fits, or without a ``context``."""
    if context is None or length <= context:
        return slice(0, 0)
    sinks = min(ATTENTION_SINK_TOKENS, context - 1)
    return slice(sinks, length - (context - sinks))


@dataclass(frozen=True)
class Reader:
    """A quantised drafting copy's twin, the same weights dequantised (``models.quantization.reader``), and the fewest
    tokens of a pass (all rows together) it was measured to run faster than the copy."""

    twin: nn.Module
    from_tokens: int


def reading_model(model: nn.Module, reader: Reader | None, tokens: int) -> nn.Module:
    """The model a drafter's pass over ``tokens`` tokens (all rows together) runs through: its reader's twin where
    it has one and the pass is as long as the twin runs faster from, else the model."""
    return reader.twin if reader is not None and tokens >= reader.from_tokens else model


class AssistantDrafter(_ModelDrafter):
    """A separate (smaller) model with the target's tokenizer and a KV cache of its own.

    With ``context``, it reads at most that many prompt tokens: the first ``ATTENTION_SINK_TOKENS``
    (StreamingLLM's attention sinks, which keep attention well behaved) and the latest ones; the
    tokens between are never fed (``skipped``), and positions run on without them.
    """

    name = "assistant"

    def __init__(
        self,
        model: nn.Module,
        logits_processor: LogitsProcessorList,
        confidence_threshold: float | None,
        do_sample: bool = False,
        inputs: ModelInputs | None = None,
        head: SubsetHead | None = None,
        context: int | None = None,
        end_tokens: frozenset[int] = frozenset(),
        reader: Reader | None = None,
    ) -> None:
        super().__init__(logits_processor, confidence_threshold, do_sample, head, end_tokens)
        self.model = model
        self.reader = reader  # the same model for long passes (a quantised copy's dequantised twin), if any
        self.inputs = inputs or ModelInputs()
        self.context = context
        self.cache = new_cache(model.config)
        self.processed: list[int] = []  # the tokens in ``cache``, drafts included until ``commit``
        self.skipped = slice(0, 0)  # the prompt positions never fed

    def prefill(self, ids: torch.Tensor) -> int:
        if self.context is not None and not self.processed and self._unpadded(ids):
            self.skipped = unread_window(ids.shape[-1], self.context)
            if self.skipped.stop:
                self.inputs = ModelInputs()  # no padding: positions simply count the tokens fed
        unread = self._pending(ids)
        if not unread.shape[1]:
            return 0
        with torch.no_grad():
            self._opening = self._forward(unread)[-1:]
        return 1

    def _unpadded(self, ids: torch.Tensor) -> bool:
        mask = self.inputs.prompt_attention_mask
        return not self.inputs.encoder_kwargs and (mask is None or bool(mask[:, : ids.shape[-1]].all()))

    def _seen(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` without the skipped prompt positions: what this drafter's cache holds, in order."""
        return torch.cat([ids[:, : self.skipped.start], ids[:, self.skipped.stop :]], dim=-1)

    def _pending(self, ids: torch.Tensor) -> torch.Tensor:
        return self._seen(ids)[:, len(self.processed) :]

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        model = reading_model(self.model, self.reader, tokens.numel())
        logits = self.inputs.logits(model, tokens, len(self.processed), self.cache, keep=1, head=self.head)
        self.processed.extend(tokens[0].tolist())
        return logits

    def commit(self, ids: torch.Tensor) -> None:
        keep = kept_prefix(self.processed, self._seen(ids)[0].tolist())
        crop_to(self.cache, keep)
        del self.processed[keep:]
        self._opening = None


class SelfDrafter(_ModelDrafter):
    """The target itself under a heavier routing mask, drafting provisionally on the target's cache."""

    name = "self"

    def __init__(
        self,
        model: nn.Module,
        mask: RoutingMask,
        target_cache: TargetCache,
        logits_processor: LogitsProcessorList,
        confidence_threshold: float | None,
        do_sample: bool = False,
        head: SubsetHead | None = None,
        end_tokens: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(logits_processor, confidence_threshold, do_sample, head, end_tokens)
        mask.validate_for(model)
        self.model = model
        self.mask = mask
        self.skipped = mask.skipped_layers  # validated once here, not on every drafting pass
        self.target_cache = target_cache
        self._fed = 0

    def _drafting(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(self.target_cache.provisional())
        stack.enter_context(skipping(self.model, self.skipped))
        return stack

    def _pending(self, ids: torch.Tensor) -> torch.Tensor:
        self._fed = self.target_cache.length
        return ids[:, self._fed :]

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.target_cache.run(self.model, tokens, self._fed, keep=1, head=self.head)
        self._fed += tokens.shape[1]
        return logits

    def commit(self, ids: torch.Tensor) -> None:
        """Nothing to forget: the provisional writes were cropped when drafting ended."""

    def prefill(self, ids: torch.Tensor) -> int:
        """Nothing of its own to process: the full model's prefill fills the cache this drafter reads."""
        return 0
