"""Refusing, with the reason and the fix, what VIA-SD decoding does not do."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from viasd_hf.masks.architectures import base_model, check_routable, is_encoder_decoder
from viasd_hf.masks.layer_skipping import skipped_layers_here
from viasd_hf.validation import is_int, wrong_type


def check_supported(
    model: nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any],
    drafter: nn.Module | None = None,
) -> None:
    """Refuse, with the reason, what this decoder does not do (yet).

    ``generation_config`` is checked first: ``generate`` has already expanded ``input_ids`` for
    ``num_beams`` and ``num_return_sequences``, which would otherwise look like a batch. Sampling
    ``num_return_sequences`` sequences per prompt is a batch of that many copies of each prompt (greedy
    decoding with more than one is refused by ``generate`` itself).
    """
    check_routable(model)
    check_takes_cache(model, "the model")
    check_not_routed(model)
    check_generation_config(generation_config)
    check_prompt(model, input_ids, model_kwargs)
    if drafter is not None and is_encoder_decoder(model):
        raise ValueError(
            "an assistant model for an encoder-decoder target is not supported yet; use prompt lookup "
            "(prompt_lookup_num_tokens=...) or the self-drafter (ViaSDConfig(self_draft_mask=...))"
        )


def check_takes_cache(model: nn.Module, role: str) -> None:
    """Every pass hands the model its KV cache as ``cache=``: a forward that does not take it (transformers before
    5.24, or remote code written for them) would take it for an unknown keyword and run without the cache, each
    pass attending to its own tokens only, a silently wrong output."""
    model = base_model(model)  # under a PEFT wrapper, whose forward passes every keyword on
    if "cache" not in inspect.signature(type(model).forward).parameters:
        import transformers

        raise ValueError(
            f"{role} ({type(model).__name__}) takes no `cache` argument in its forward, which VIA-SD passes the KV "
            f"cache as (transformers {transformers.__version__} is installed): upgrade with "
            "`pip install 'transformers>=5.24'`; a model with remote code needs a version written for it"
        )


def check_not_routed(model: nn.Module) -> None:
    """VIA-SD's full tier must be the full model: inside a user's ``routed()`` block it would be the slimmed one."""
    skipped = skipped_layers_here(model)
    if skipped:
        raise ValueError(
            f"VIA-SD was called inside routed(model, mask), which skips decoder layers {skipped}: its full-model tier "
            "would run the slimmed model, so no output would be the full model's; call generate outside the "
            "routed() block (VIA-SD routes its own slim tier, from ViaSDConfig.routing_mask)"
        )


def check_generation_config(generation_config: GenerationConfig) -> None:
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"VIA-SD does not support beam search (num_beams={generation_config.num_beams}); use num_beams=1"
        )
    check_drafting_options(generation_config)
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"VIA-SD does not support classifier-free guidance (guidance_scale={generation_config.guidance_scale}): "
            "its logits processor runs the model on one new token per call and keeps a cache between calls, as if "
            "each call were the next generated token, but VIA-SD also calls the processors for draft tokens and for "
            "several positions per verifying pass, so its output would differ from generate's; drop guidance_scale "
            "(or set it to 1), or use plain generate"
        )
    if generation_config.return_dict_in_generate:
        for flag, what in (("output_attentions", "attentions"), ("output_hidden_states", "hidden states")):
            if getattr(generation_config, flag, False):
                raise ValueError(
                    f"VIA-SD cannot return {what} ({flag}=True): its tokens come from passes of different models "
                    f"(drafter, slim verifier, full model) over different positions, so there are no per-step {what} "
                    f"as generate returns them; drop {flag}, or use plain generate"
                )


def check_drafting_options(generation_config: GenerationConfig) -> None:
    """HF's drafting options that VIA-SD reads (``prompt_lookup_num_tokens``) or would silently ignore."""
    tokens = generation_config.prompt_lookup_num_tokens
    if tokens is not None and not is_int(tokens):
        expected = "a whole number of tokens to copy per draft"
        raise wrong_type("prompt_lookup_num_tokens", expected, tokens, advice="e.g. prompt_lookup_num_tokens=10")
    if tokens is not None and tokens < 1:
        raise ValueError(
            f"prompt_lookup_num_tokens must be >= 1 (the tokens each lookup draft copies), got {tokens}; "
            "leave it out to draft without prompt lookup"
        )
    if generation_config.assistant_early_exit is not None:
        raise ValueError(
            f"VIA-SD does not draft by early exit (assistant_early_exit={generation_config.assistant_early_exit}): "
            "its self-drafter is the target routed with a drafting mask; drop assistant_early_exit and pass "
            "ViaSDConfig(self_draft_mask=...) (e.g. viasd_hf.dimr.early_exit_mask(model, k), which skips late "
            "layers), or call generate without viasd_config for HF's early-exit drafting"
        )


def check_prompt(model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
    """Non-empty sequences of token ids, with an attention mask (if any) of the same length; what a batch of more
    than one needs besides is checked by ``engine.batch.preconditions``."""
    if not is_encoder_decoder(model) and model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "VIA-SD cannot use inputs_embeds: every tier (drafter, prompt lookup, slim verifier, full model) is fed "
            "token ids; pass input_ids only"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("VIA-SD needs at least one prompt, got a batch of 0")
    if input_ids.shape[1] == 0:
        raise ValueError("VIA-SD needs a prompt of at least one token, got empty input_ids; start from the BOS token")
    if is_encoder_decoder(model):
        return  # the attention mask there is the encoder's
    width = _attention_mask_width(input_ids, model_kwargs)
    if width != input_ids.shape[1]:
        raise ValueError(
            f"attention_mask has {width} positions but input_ids has {input_ids.shape[1]} tokens; "
            "pass an attention_mask with one entry per input token"
        )


def _attention_mask_width(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> int:
    """The positions the user's attention mask covers: ``generate`` drops an all-ones mask, but only after
    making ``position_ids`` of the mask's length from it."""
    for name in ("attention_mask", "position_ids"):
        if model_kwargs.get(name) is not None:
            return model_kwargs[name].shape[-1]
    return input_ids.shape[1]
