"""What a decode has committed, and the one KV cache every tier of the target shares (docs/design.md, "The KV cache").

There is one cache, the full model's. The slim verifier and the self-drafter read its committed
prefix and their provisional writes are cropped right away, so every self-attention layer always
holds exactly ``TargetCache.length`` tokens: those the full model has processed. Tokens committed
on the slim tier's authority are not in it yet; the full model processes them on its next pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from viasd_hf.engine.branching import keep_leaf
from viasd_hf.engine.kv_cache import crop_to, layer_lengths
from viasd_hf.vocabulary.head import SubsetHead


class CacheInvariantError(AssertionError):
    """The target's cache no longer holds exactly the tokens the full model has processed."""


@dataclass(frozen=True)
class ModelInputs:
    """What every forward pass of a call feeds besides its tokens: positions under a left-padded prompt, and
    the encoder output ``generate`` computed once (encoder-decoder models)."""

    prompt_attention_mask: torch.Tensor | None = None
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)

    def position_kwargs(self, start: int, count: int) -> dict[str, torch.Tensor]:
        """Attention mask and positions for ``count`` tokens at ``start`` when the prompt is left-padded."""
        if self.prompt_attention_mask is None:
            return {}
        prompt = self.prompt_attention_mask
        total = start + count
        extension = torch.ones((1, max(0, total - prompt.shape[1])), dtype=prompt.dtype, device=prompt.device)
        mask = torch.cat([prompt, extension], dim=-1)[:, :total]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        return {"attention_mask": mask, "position_ids": positions[:, start:total]}

    def logits(
        self, model: nn.Module, tokens: torch.Tensor, start: int, cache: Any, keep: int, head: SubsetHead | None = None,
        layout: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of the last ``keep`` of ``tokens`` (fed at position ``start``), one row per token.

        Decoder-only models run the LM head on those rows only: with a 150k vocabulary the head is
        a large share of a pass. With ``head`` (a draft vocabulary) only its rows of the LM head run.
        ``layout``: an attention mask and positions of the pass's own (a token tree, ``branching``).
        """
        positions = layout if layout is not None else self.position_kwargs(start, tokens.shape[1])
        if head is not None:
            return head.logits(model, tokens, cache, keep, **positions)
        if self.encoder_kwargs:
            output = model(decoder_input_ids=tokens, cache=cache, use_cache=True, **self.encoder_kwargs)
            return output.logits[0, -keep:]
        output = model(tokens, cache=cache, use_cache=True, logits_to_keep=keep, **positions)
        return output.logits[0]


class TargetCache:
    """The target's KV cache, shared by the full model, the slim verifier and the self-drafter.

    ``length`` tokens are in every self-attention layer, written by the full model. ``run`` feeds
    tokens after them; inside ``provisional()`` (routed passes) whatever was written is cropped on
    exit, and after a full pass ``keep`` says how many of its tokens stay.
    """

    def __init__(self, cache: Any, inputs: ModelInputs) -> None:
        self.cache = cache
        self.inputs = inputs
        self.length = 0

    def run(
        self, model: nn.Module, tokens: torch.Tensor, start: int, keep: int, head: SubsetHead | None = None,
        layout: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of the last ``keep`` of ``tokens`` fed at position ``start`` (``length`` or beyond, in a provisional
        pass); over ``head``'s vocabulary only when given; ``layout``: the pass's own mask and positions."""
        return self.inputs.logits(model, tokens, start, self.cache, keep, head, layout)

    @property
    def padded(self) -> bool:
        """Whether the prompt is left-padded (its attention mask holds zeros)."""
        mask = self.inputs.prompt_attention_mask
        return mask is not None and not bool(mask.all())

    @contextmanager
    def provisional(self) -> Iterator[None]:
        """Passes inside write nothing that lasts: the cache is cropped back to ``length`` on exit."""
        try:
            yield
        finally:
            crop_to(self.cache, self.length)

    def keep(self, length: int) -> None:
        """After a full pass: its first ``length`` tokens stay in the cache, the rest (rejected drafts) go."""
        crop_to(self.cache, length)
        self.length = length

    def keep_leaf(self, length: int, leaf_index: int) -> None:
        """After a full pass whose leaf (``branching``) was taken: its first ``length`` tokens, then the leaf."""
        keep_leaf(self.cache, length, leaf_index)
        self.length = length + 1

    def check(self) -> None:
        lengths = layer_lengths(self.cache)
        if any(length != self.length for length in lengths):
            raise CacheInvariantError(f"cache layer lengths {lengths} != tokens the full model processed ({self.length})")


@dataclass
class DecodingState:
    """The committed sequence, the target's cache of (a prefix of) it, and the outputs ``generate`` returns."""

    ids: torch.Tensor
    target_cache: TargetCache
    scores: list[torch.Tensor] = field(default_factory=list)  # output_scores: one (1, vocab) row per new token
    logits: list[torch.Tensor] = field(default_factory=list)  # output_logits: likewise, raw

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def unprocessed(self) -> torch.Tensor:
        """Committed tokens the full model has not processed: the newest one, and any the slim tier committed."""
        return self.ids[:, self.target_cache.length :]

    def append(self, token: int) -> None:
        self.ids = torch.cat([self.ids, self.ids.new_tensor([[token]])], dim=-1)
