"""What VIA-SD decodes for several prompts at once, and, for what it does not, the reason and the fix.

One prompt is a batch of one, whose cache never holds a hole (``ragged_cache``): it takes every model and option that
``engine.preconditions`` admits, streamers and encoder-decoder models included. A batch of more than one decodes in lossless or tiered mode, greedily or sampling, from left-padded
prompts (with their attention mask, or none when they have one length), drafted by an assistant model,
prompt lookup, both, or the self-drafter. ``return_dict_in_generate`` returns the sequences, ``viasd_stats``
and, where asked for, each new token's scores and logits, step by step as ``generate`` returns them
(``rows.Rows.per_step``). Streamers take one prompt, as
``generate``'s do.

The target and the assistant may have sliding-window layers (every layer, or some beside full-attention ones, as
``config.layer_types`` or ``sliding_window`` says), on SDPA or eager attention: the ragged cache masks each row's
window by its tokens' positions (``position_masks``). Layers of other kinds (chunked or linear attention, a cache
shared between layers) and, with sliding windows, attention that reads no 4D mask (flash, flex) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxLengthCriteria, MaxTimeCriteria

from viasd_hf.engine.batch.position_masks import unmaskable
from viasd_hf.engine.kv_cache import check_empty
from viasd_hf.masks.architectures import is_encoder_decoder, model_config

SUPPORTED = ("batched VIA-SD decodes left-padded prompts in lossless or tiered mode, greedily or sampling, drafted "
             "by an assistant model (assistant_model=...), prompt lookup (prompt_lookup_num_tokens=...), both, or the "
             "self-drafter (ViaSDConfig(self_draft_mask=...))")
ONE_AT_A_TIME = "or call generate once per prompt"
Refuse = Callable[[str, str], NoReturn]  # (what is not supported, the fix) -> raises the ValueError


def check_batch_supported(
    model: nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, drafter: nn.Module | None,
    streamer: Any, stopping_criteria: StoppingCriteriaList, model_kwargs: dict[str, Any],
) -> None:
    """Refuse, naming what is supported and the fix, what VIA-SD does not do for more than one prompt at once (yet)."""
    batch = f"a batch of {input_ids.shape[0]}"
    copies = generation_config.num_return_sequences or 1
    if copies > 1:  # generate repeated each prompt: name the batch as the user asked for it
        prompts = input_ids.shape[0] // copies
        batch += f" ({prompts} prompt{'s' * (prompts != 1)} x num_return_sequences={copies})"

    def refuse(what: str, fix: str) -> NoReturn:
        raise ValueError(f"{what}, got {batch}: {SUPPORTED}; {fix}")

    check_empty(model_kwargs.get("cache"))
    check_padding(input_ids, model_kwargs, refuse)
    if input_ids.shape[0] == 1:
        return  # one sequence: its cache never holds a hole, so every model and option of ``generate`` works
    if streamer is not None:  # transformers' own words (TextStreamer), the fix after them
        name = type(streamer).__name__
        raise ValueError(f"{name} only supports batch size 1: stream one prompt per generate call, or drop the streamer "
                         f"to decode {batch}")
    if is_encoder_decoder(model):
        refuse("batched VIA-SD does not decode encoder-decoder models", ONE_AT_A_TIME)
    check_stopping(stopping_criteria, refuse)
    for which, module in (("target", model), ("assistant model", drafter)):
        why = unmaskable(model_config(module)) if module is not None else None
        if why is not None:
            refuse(f"batched VIA-SD keeps rejected drafts as masked holes in one cache per model, and the {which} "
                   f"{why}", ONE_AT_A_TIME)


def check_padding(input_ids: torch.Tensor, model_kwargs: dict[str, Any], refuse: Refuse) -> None:
    """Prompts padded on the left (each row's last token real) with at least one real token each."""
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        return
    if mask.shape != input_ids.shape:
        refuse(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}",
               "pass one mask entry per input token")
    if not bool(mask.any(-1).all()):
        refuse("a prompt of the batch is all padding", "drop it or give it at least one token")
    if not bool(mask[:, -1].all()):
        refuse("batched VIA-SD needs left-padded prompts, and some are padded on the right",
               "tokenize with padding_side='left' (tokenizer.padding_side = 'left')")


def check_stopping(stopping_criteria: StoppingCriteriaList, refuse: Refuse) -> None:
    """Rows stop one by one. ``generate`` pads a finished row only when an EOS criterion is present; without one, it
    keeps decoding rows other criteria stopped until every row has stopped, which batched VIA-SD does not do."""
    has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    others = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, MaxTimeCriteria))]
    if not has_eos and others:
        refuse(f"without eos_token_id, generate keeps decoding the rows that {', '.join(others)} stopped until every "
               "row has stopped, and batched VIA-SD stops each row on its own",
               f"set eos_token_id (and pad_token_id), {ONE_AT_A_TIME}")
