"""Plugging VIA-SD into ``model.generate``.

Three entry points, all ending in ``viasd_generate``, the ``custom_generate`` callable:

- ``model.generate(..., custom_generate=viasd_generate, drafter=..., viasd_config=...)``;
- ``ViaSDGenerationMixin`` for model classes, and ``enable_viasd(model)`` for a loaded model:
  afterwards ``model.generate(..., assistant_model=..., viasd_config=...)`` runs VIA-SD and a
  call without ``viasd_config`` is plain ``generate``.

``generate`` prepares logits processors, stopping criteria, lengths and attention masks, then
calls the callable — but forwards neither ``assistant_model`` nor ``streamer`` to it, so the
mixin passes them under the callable's own names (DESIGN §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .architectures import base_model, is_encoder_decoder, model_config
from .cache import new_cache
from .config import ViaSDConfig
from .decoding import DecodingState, ViaSDDecoder, check_supported
from .drafters import AssistantDrafter, Drafter, PromptLookupDrafter, SelfDrafter
from .masks import RoutingMask
from .stats import ViaSDStats


@dataclass
class ViaSDDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``generate``'s usual output plus what each VIA-SD tier did."""

    viasd_stats: ViaSDStats | None = None


@dataclass
class ViaSDEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``generate``'s usual encoder-decoder output plus what each VIA-SD tier did."""

    viasd_stats: ViaSDStats | None = None


def resolve_mask(spec: RoutingMask | str | None, model: nn.Module, drafter_id: str) -> RoutingMask:
    """A validated mask from a ``RoutingMask``, a local path or Hub id, or else the mask known for this pair."""
    if isinstance(spec, RoutingMask):
        mask = spec
    elif spec is not None:
        mask = RoutingMask.from_pretrained(spec)
    else:
        mask = RoutingMask.from_pretrained((str(model_config(model)._name_or_path), drafter_id))
    mask.validate_for(model)
    return mask


def _drafter_id(assistant_model: nn.Module | None) -> str:
    """The drafter a slim mask is looked up for; model-free drafters use the target's own ("self") mask."""
    return str(model_config(assistant_model)._name_or_path) if assistant_model is not None else "self"


def check_same_vocabulary(model: nn.Module, assistant_model: nn.Module) -> None:
    target_vocab = base_model(model).get_output_embeddings().weight.shape[0]
    drafter_vocab = base_model(assistant_model).get_output_embeddings().weight.shape[0]
    if target_vocab != drafter_vocab:
        raise ValueError(
            f"the assistant model's vocabulary ({drafter_vocab} tokens) differs from the target's ({target_vocab}): "
            "VIA-SD needs a drafter that shares the target's tokenizer. Supported drafters: an assistant model with "
            "the same tokenizer, prompt lookup (prompt_lookup_num_tokens=...), or the self-drafter "
            "(ViaSDConfig(self_draft_mask=...))"
        )


def build_drafter(
    model: nn.Module,
    config: ViaSDConfig,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList,
    assistant_model: nn.Module | None,
) -> Drafter:
    """Choose the drafter as HF users expect: assistant model, else prompt lookup, else the self-drafter."""
    if assistant_model is not None:
        if is_encoder_decoder(model):
            raise ValueError(
                "an assistant model for an encoder-decoder target is not supported yet; use prompt lookup "
                "(prompt_lookup_num_tokens=...) or the self-drafter (ViaSDConfig(self_draft_mask=...))"
            )
        check_same_vocabulary(model, assistant_model)
        return AssistantDrafter(
            assistant_model, logits_processor, config.draft_confidence_threshold, generation_config.do_sample
        )
    if generation_config.prompt_lookup_num_tokens:
        return PromptLookupDrafter(generation_config.prompt_lookup_num_tokens)
    mask = resolve_mask(config.self_draft_mask, model, "self-drafter")
    return SelfDrafter(model, mask, logits_processor, config.draft_confidence_threshold, generation_config.do_sample)


def initial_state(model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> DecodingState:
    """The prompt and ``generate``'s empty cache; the encoder output too, for encoder-decoder models."""
    cache = new_cache(model_config(model), model_kwargs.get("cache"))
    if is_encoder_decoder(model):
        encoder = {"encoder_outputs": model_kwargs["encoder_outputs"], "attention_mask": model_kwargs.get("attention_mask")}
        return DecodingState(input_ids, cache, full_length=0, prompt_attention_mask=None, encoder_kwargs=encoder)
    return DecodingState(input_ids, cache, full_length=0, prompt_attention_mask=model_kwargs.get("attention_mask"))


def viasd_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    viasd_config: ViaSDConfig | None = None,
    drafter: nn.Module | None = None,
    viasd_streamer: Any = None,
    viasd_check_invariants: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor | ViaSDDecoderOnlyOutput | ViaSDEncoderDecoderOutput:
    """``custom_generate`` callable: VIA-SD decoding with ``drafter`` (an assistant model) or the config's choice."""
    config = viasd_config or ViaSDConfig()
    check_supported(model, input_ids, generation_config)
    chosen = build_drafter(model, config, generation_config, logits_processor, drafter)
    slim_mask = None
    if config.use_slim:
        slim_mask = resolve_mask(config.routing_mask, model, _drafter_id(drafter))
    keep_scores = bool(generation_config.output_scores)
    decoder = ViaSDDecoder(
        model,
        chosen,
        config,
        slim_mask,
        logits_processor,
        stopping_criteria,
        max_length=generation_config.max_length,
        streamer=viasd_streamer,
        keep_scores=keep_scores,
        check_invariants=viasd_check_invariants,
        do_sample=bool(generation_config.do_sample),
    )
    state = decoder.run(initial_state(model, input_ids, model_kwargs))
    if not generation_config.return_dict_in_generate:
        return state.ids
    scores = tuple(state.scores) if keep_scores else None
    if is_encoder_decoder(model):
        return ViaSDEncoderDecoderOutput(sequences=state.ids, scores=scores, viasd_stats=decoder.stats)
    return ViaSDDecoderOnlyOutput(sequences=state.ids, scores=scores, viasd_stats=decoder.stats)


class ViaSDGenerationMixin:
    """Mix into a model class (before the transformers class) to accept ``viasd_config`` in ``generate``."""

    def generate(self, *args: Any, viasd_config: ViaSDConfig | None = None, **kwargs: Any) -> Any:
        if viasd_config is None:
            return super().generate(*args, **kwargs)
        return super().generate(*args, **viasd_generate_kwargs(viasd_config, kwargs))


def viasd_generate_kwargs(viasd_config: ViaSDConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``generate`` kwargs so HF's preparation runs and then hands over to ``viasd_generate``."""
    kwargs = dict(kwargs)
    stop_strings = kwargs.pop("stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    kwargs["drafter"] = kwargs.pop("assistant_model", None)
    kwargs["viasd_streamer"] = kwargs.pop("streamer", None)
    kwargs["viasd_config"] = viasd_config
    kwargs["custom_generate"] = viasd_generate
    return kwargs


_VIASD_CLASSES: dict[type, type] = {}


def enable_viasd(model: nn.Module) -> nn.Module:
    """Give an already-loaded model VIA-SD ``generate`` (in place, returned for chaining)."""
    cls = type(model)
    if issubclass(cls, ViaSDGenerationMixin):
        return model
    if cls not in _VIASD_CLASSES:
        _VIASD_CLASSES[cls] = type(f"ViaSD{cls.__name__}", (ViaSDGenerationMixin, cls), {})
    model.__class__ = _VIASD_CLASSES[cls]
    return model
