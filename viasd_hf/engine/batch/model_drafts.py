"""What drafting with a model needs (``engine.batch.drafting`` drafts for every row at once): the token drafted
from processed scores, what a drafter's cache keeps after a block, the part of a long prompt it reads, and the
reader that runs its long passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from viasd_hf.engine.decisions import forbidden
from viasd_hf.engine.sampling import RandomStream, sample

ATTENTION_SINK_TOKENS = 4  # prompt tokens a windowed drafter always keeps (Xiao et al., "Efficient Streaming LMs")


def drafted_token(scores: torch.Tensor, do_sample: bool, rng: RandomStream | None) -> tuple[int, torch.Tensor] | None:
    """The token drafted from processed ``scores`` (``[1, vocab]``), the argmax or a sample, and the distribution it
    was drawn from; ``None`` where the logits processors allow no token (the draft ends there)."""
    if forbidden(scores).all():
        return None
    probs = scores.softmax(-1)[0]
    return (sample(probs, rng) if do_sample else int(scores.argmax(-1))), probs


def second_choice(scores: torch.Tensor) -> int | None:
    """The token a greedy drafter ranks second in processed ``scores`` (``[1, vocab]``); ``None`` where the processors
    allow only one."""
    if scores.shape[-1] < 2:
        return None
    runner_up = scores[0].topk(2)
    return None if forbidden(runner_up.values[1:]).all() else int(runner_up.indices[1])


def kept_prefix(processed: list[int], committed: list[int]) -> int:
    """How many of the tokens a drafter's cache holds (``processed``, in order) it keeps after a block: those up to the
    first that differs from the ``committed`` sequence, but never the newest committed token, which is fed with the
    next draft."""
    keep = next((i for i, (mine, theirs) in enumerate(zip(processed, committed)) if mine != theirs), len(processed))
    return min(keep, len(committed) - 1)


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
