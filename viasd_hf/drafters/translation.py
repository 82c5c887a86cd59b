"""Drafting with a model of another tokenizer (HF's "universal assisted generation"): text is what the two share.

The drafter reads the target's committed text in its own tokens, drafts in them, and its draft is handed to the
target as the target's tokens of the same text: decoded with the drafter's tokenizer, re-encoded with the
target's after the committed text, the tokens past it kept. A draft whose first token would merge with the
committed text (the target committed " hel" and the draft goes on "lo") is not proposed at all: the target
cannot rewrite what it committed. The last re-encoded token may still change once more text follows (" sat"
becoming " saturday"), but it is kept: a rejected last draft commits the very token the target would have added
after the others (its verdict at a position does not depend on the drafts after it), and one more column of the
verifying pass costs next to nothing, so dropping it could only lose the tokens it is right about (and a draft
the confidence threshold stopped after one token would never be proposed). Either way the target verifies the
draft as any other, so what it commits is its own choice: translation changes how many drafts it keeps, never
which tokens it outputs.

As in HF, the two tokenizers are passed to ``generate`` (``tokenizer=``, ``assistant_tokenizer=``); without them
a drafter of another vocabulary is refused, since its token ids mean nothing to the target.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd_hf.engine.preconditions import check_takes_cache
from viasd_hf.masks.architectures import base_model

SEAM = 16  # the tokens before a draft that are decoded and re-encoded with it: enough for any merge across the seam


class Translation:
    """The target's tokenizer and the drafter's, and how contexts and drafts pass between them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.drafter_tokenizer = drafter_tokenizer
        # a draft ends at any special token of the drafter: translating drops their text, so what follows one is not
        # the text it drafted
        self.drafter_ends = frozenset(drafter_tokenizer.all_special_ids)
        # what the drafter reads where the target's text is empty (a prompt of special tokens): it drafts from a token
        starts = (drafter_tokenizer.bos_token_id, drafter_tokenizer.eos_token_id)
        self.start = next((token for token in starts if token is not None), 0)

    def context(self, committed: list[int]) -> list[int]:
        """The drafter's tokens of the target's ``committed`` text, as HF's universal assisted generation reads it:
        without the target's special tokens, with the drafter's own (its BOS)."""
        text = self.tokenizer.decode(committed, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return self.drafter_tokenizer(text, add_special_tokens=True)["input_ids"] or [self.start]

    def draft(self, committed: list[int], context: list[int], drafted: list[int]) -> list[int]:
        """The target's tokens for the text the drafter's ``drafted`` tokens add after its ``context``, as the target
        can commit them after its ``committed`` tokens."""
        text = added_text(self.drafter_tokenizer, context[-SEAM:], drafted)
        return continuation(self.tokenizer, committed[-SEAM:], text) if text else []


def added_text(tokenizer: PreTrainedTokenizerBase, before: list[int], after: list[int]) -> str:
    """The text ``after`` adds to ``before``, decoded together so that spacing at the seam comes out as the
    tokenizer writes it ('' where ``after`` would rewrite the text of ``before``); special tokens write nothing."""
    head = tokenizer.decode(before, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    whole = tokenizer.decode(before + after, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return whole[len(head) :] if whole.startswith(head) else ""


def continuation(tokenizer: PreTrainedTokenizerBase, before: list[int], text: str) -> list[int]:
    """The tokens ``tokenizer`` writes ``text`` in after the text of ``before``: those past the encoding of that text
    alone, where adding ``text`` leaves that encoding as it was; none where a token would straddle the seam."""
    head = tokenizer.decode(before, clean_up_tokenization_spaces=False)
    alone = tokenizer.encode(head, add_special_tokens=False)
    whole = tokenizer.encode(head + text, add_special_tokens=False)
    return whole[len(alone) :] if whole[: len(alone)] == alone else []


def drafter_translation(model: nn.Module, drafter: nn.Module | None, tokenizer: PreTrainedTokenizerBase | None,
                        drafter_tokenizer: PreTrainedTokenizerBase | None, streamer: Any = None) -> Translation | None:
    """How the drafter's tokens become the target's: ``None`` where they already are (no drafter, or one of the
    target's tokenizer), a ``Translation`` through text where both tokenizers are given and differ. A drafter of
    another vocabulary without them is refused, naming the fix, as HF's ``generate`` refuses it."""
    if drafter is None:
        return None
    check_takes_cache(drafter, "the assistant model")
    both = tokenizer is not None and drafter_tokenizer is not None
    if both and tokenizer.get_vocab() != drafter_tokenizer.get_vocab():
        if streamer is not None:
            raise ValueError("a drafter of another tokenizer drafts in the batched engine, which does not stream: drop "
                             "the streamer, or draft with a model of the target's tokenizer")
        return Translation(tokenizer, drafter_tokenizer)
    target_vocab, drafter_vocab = _head_rows(model), _head_rows(drafter)
    if target_vocab != drafter_vocab:
        raise ValueError(
            f"the assistant model's vocabulary ({drafter_vocab} tokens) differs from the target's ({target_vocab}): "
            "VIA-SD drafts with it through text, as HF's universal assisted generation does, when generate is given "
            "both tokenizers: generate(..., assistant_model=..., tokenizer=<the target's>, assistant_tokenizer=<the "
            "assistant's>) (with custom_generate=viasd_generate, which generate hands neither: viasd_tokenizer=... and "
            "drafter_tokenizer=...). Otherwise draft with a model that shares the target's tokenizer, prompt lookup "
            "(prompt_lookup_num_tokens=...), or the self-drafter (ViaSDConfig(self_draft_mask=...))"
        )
    return None


def _head_rows(model: nn.Module) -> int:
    return base_model(model).get_output_embeddings().weight.shape[0]
