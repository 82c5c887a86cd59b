"""Plugging VIA-SD into ``model.generate``.

Three entry points, all ending in ``viasd_generate``, the ``custom_generate`` callable:

- ``model.generate(..., custom_generate=viasd_generate, drafter=..., viasd_config=...)``;
- ``ViaSDGenerationMixin`` for model classes, and ``enable_viasd(model)`` for a loaded model:
  afterwards ``model.generate(..., assistant_model=..., viasd_config=...)`` runs VIA-SD and a
  call without ``viasd_config`` is plain ``generate``.

``generate`` prepares logits processors, stopping criteria, lengths and attention masks, then
calls the callable — but forwards neither ``assistant_model`` nor ``streamer`` to it, so the
mixin passes them under the callable's own names (docs/design.md, "Plugging into generate"), and ``viasd_generate`` recovers
them from ``generate``'s frame when a user passed them with ``custom_generate=viasd_generate``.

``enable_viasd`` binds ``generate`` on the instance, as transformers binds a Hub
``custom_generate``: the model's class, config, weights and pickling stay untouched.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import StaticCosts
from viasd_hf.control.hybrid_choice import CopyOrDraft
from viasd_hf.drafters import AssistantDrafter, Drafter, HybridDrafter, PromptLookupDrafter, SelfDrafter
from viasd_hf.drafters.precision import drafter_for_call, drafting_reader
from viasd_hf.drafters.translation import Translation, drafter_translation
from viasd_hf.engine.batch import BatchedDecoder, RaggedCache, batch_drafter, check_batch_supported
from viasd_hf.engine.batch.translating import translating_drafter
from viasd_hf.engine.kv_cache import new_cache
from viasd_hf.engine.loop import ViaSDDecoder
from viasd_hf.engine.preconditions import check_supported
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.state import DecodingState, ModelInputs, TargetCache
from viasd_hf.engine.stats import ViaSDStats
from viasd_hf.masks.architectures import is_encoder_decoder, model_config
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.resolver import CallMasks, masks_for_call
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.vocabulary.head import SubsetHead
from viasd_hf.vocabulary.lookup import tier_heads


@dataclass
class ViaSDDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``generate``'s usual output plus what each VIA-SD tier did."""

    viasd_stats: ViaSDStats | None = None


@dataclass
class ViaSDEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``generate``'s usual encoder-decoder output plus what each VIA-SD tier did."""

    viasd_stats: ViaSDStats | None = None


def _drafter_id(assistant_model: nn.Module | None) -> str:
    """The drafter a slim mask is looked up for; model-free drafters use the target's own ("self") mask."""
    return str(model_config(assistant_model)._name_or_path) if assistant_model is not None else "self"


def end_tokens(generation_config: GenerationConfig) -> frozenset[int]:
    """The tokens that end generation (``eos_token_id``: one, a list, or none): a draft stops at one."""
    eos = generation_config.eos_token_id
    return frozenset() if eos is None else frozenset(torch.as_tensor(eos).flatten().tolist())


def prompt_lookup(
    model: nn.Module, generation_config: GenerationConfig, logits_processor: LogitsProcessorList
) -> PromptLookupDrafter | None:
    """Prompt lookup copying ``prompt_lookup_num_tokens`` per draft (``None`` without it), each copy cut before a
    token the logits processors forbid and after an end token."""
    if not generation_config.prompt_lookup_num_tokens:
        return None
    vocab_size = model_config(model).get_text_config().vocab_size
    return PromptLookupDrafter(generation_config.prompt_lookup_num_tokens, logits_processor, vocab_size,
                               end_tokens=end_tokens(generation_config))


def build_drafter(
    model: nn.Module,
    config: ViaSDConfig,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList,
    assistant_model: nn.Module | None,
    target_cache: TargetCache,
    self_draft_mask: RoutingMask | None,
    head: SubsetHead | None = None,
) -> Drafter:
    """Choose the drafter as HF users expect: assistant model, else prompt lookup, else the self-drafter.

    ``assistant_model`` together with ``prompt_lookup_num_tokens`` drafts by prompt lookup where the
    context repeats itself and with the assistant elsewhere (``HybridDrafter``); with ``adaptive=True``,
    only while copying commits more per unit of cost (``hybrid_choice``). ``head``: the drafting
    model's LM head cut to a draft vocabulary.
    """
    ends = end_tokens(generation_config)
    lookup = prompt_lookup(model, generation_config, logits_processor)
    if assistant_model is None:
        if lookup is not None:
            return lookup
        return SelfDrafter(model, self_draft_mask, target_cache, logits_processor, config.draft_confidence_threshold,
                           generation_config.do_sample, head, ends)
    assistant = AssistantDrafter(
        assistant_model, logits_processor, config.draft_confidence_threshold, generation_config.do_sample,
        inputs=target_cache.inputs, head=head, context=config.drafter_context, end_tokens=ends,
        reader=drafting_reader(assistant_model),
    )
    if lookup is None:
        return assistant
    choice = CopyOrDraft(StaticCosts.for_drafter(model, assistant_model, None).drafter) if config.adaptive else None
    return HybridDrafter(lookup, assistant, choice)


def call_masks(
    model: nn.Module, config: ViaSDConfig, generation_config: GenerationConfig, drafter: nn.Module | None
) -> CallMasks:
    """The slim tier's mask and, when the target drafts for itself (no assistant, no prompt lookup), the self-drafter's
    (``resolver.masks_for_call``: a pair without a mask decodes without the slim tier, unless in tiered mode)."""
    return masks_for_call(
        model, _drafter_id(drafter), config.routing_mask, config.self_draft_mask, use_slim=config.use_slim,
        slim_required=config.mode == "tiered", self_drafts=drafter is None and not generation_config.prompt_lookup_num_tokens,
    )  # fmt: skip


def initial_state(model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> DecodingState:
    """The prompt and ``generate``'s empty cache; the encoder output too, for encoder-decoder models."""
    cache = new_cache(model_config(model), model_kwargs.get("cache"))
    if is_encoder_decoder(model):
        encoder = {"encoder_outputs": model_kwargs["encoder_outputs"], "attention_mask": model_kwargs.get("attention_mask")}
        inputs = ModelInputs(encoder_kwargs=encoder)
    else:
        inputs = ModelInputs(prompt_attention_mask=model_kwargs.get("attention_mask"))
    return DecodingState(input_ids, TargetCache(cache, inputs))


class _AfterPrompt(BaseStreamer):
    """A user's streamer to which ``generate`` has already put the prompt: the decoder's own put of it is dropped."""

    def __init__(self, streamer: BaseStreamer) -> None:
        self.streamer = streamer
        self.prompt_dropped = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_dropped:
            self.streamer.put(value)
        self.prompt_dropped = True

    def end(self) -> None:
        self.streamer.end()


_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


def _taken_from_generate(drafter: nn.Module | None, streamer: Any) -> tuple[nn.Module | None, Any]:
    """The drafter and streamer, counting the ``assistant_model`` / ``streamer`` that ``generate`` kept back.

    ``GenerationMixin.generate`` hands a ``custom_generate`` callable neither argument (docs/design.md, "Plugging into generate"), so
    ``generate(custom_generate=viasd_generate, assistant_model=a)`` would silently run another
    drafter. They are still ``generate``'s locals: read them from its frame, our direct caller.
    """
    caller = sys._getframe(2)
    if caller.f_code is not _GENERATE_CODE:
        return drafter, streamer
    assistant_model, their_streamer = caller.f_locals.get("assistant_model"), caller.f_locals.get("streamer")
    if assistant_model is not None:
        if drafter is not None and drafter is not assistant_model:
            raise ValueError("generate got both assistant_model= and drafter=, two different models: pass one of them")
        drafter = assistant_model
    if their_streamer is not None:
        if streamer is not None:
            raise ValueError("generate got both streamer= and viasd_streamer=: pass one of them")
        streamer = _AfterPrompt(their_streamer)
    return drafter, streamer


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
    viasd_tokenizer: Any = None,
    drafter_tokenizer: Any = None,
    **model_kwargs: Any,
) -> torch.Tensor | ViaSDDecoderOnlyOutput | ViaSDEncoderDecoderOutput:
    """``custom_generate`` callable: VIA-SD decoding with ``drafter`` (an assistant model) or the config's choice; a
    drafter of another tokenizer drafts through text (``viasd_tokenizer``, ``drafter_tokenizer``: ``generate``'s
    ``tokenizer`` and ``assistant_tokenizer``), in the batched engine, as a batch of one where there is one prompt."""
    drafter, viasd_streamer = _taken_from_generate(drafter, viasd_streamer)
    config = ViaSDConfig.for_call(viasd_config)
    check_supported(model, input_ids, generation_config, model_kwargs, drafter)
    translation = drafter_translation(model, drafter, viasd_tokenizer, drafter_tokenizer, viasd_streamer)
    if input_ids.shape[0] > 1 or translation is not None:
        return generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, config, drafter,
                              viasd_streamer, viasd_check_invariants, model_kwargs, translation)
    drafter = drafter_for_call(drafter, config, bool(generation_config.do_sample))
    state = initial_state(model, input_ids, model_kwargs)
    copies = bool(generation_config.prompt_lookup_num_tokens)
    drafter_head, slim_head = tier_heads(config.vocabulary, model, drafter, _drafter_id(drafter), copies,
                                         tuple(config.vocabulary_tiers))
    masks = call_masks(model, config, generation_config, drafter)
    chosen = build_drafter(model, config, generation_config, logits_processor, drafter, state.target_cache,
                           masks.self_draft, drafter_head)
    keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    decoder = ViaSDDecoder(
        model,
        chosen,
        config,
        masks.slim,
        logits_processor,
        stopping_criteria,
        max_length=generation_config.max_length,
        streamer=viasd_streamer,
        keep_scores=keep_scores,
        keep_logits=keep_logits,
        check_invariants=viasd_check_invariants,
        do_sample=bool(generation_config.do_sample),
        slim_head=slim_head,
    )
    decoder.run(state)
    if not generation_config.return_dict_in_generate:
        return state.ids
    outputs = {
        "sequences": state.ids,
        "scores": tuple(state.scores) if keep_scores else None,
        "logits": tuple(state.logits) if keep_logits else None,  # raw, from the tier that chose each token
        "viasd_stats": decoder.stats,
    }
    if is_encoder_decoder(model):
        return ViaSDEncoderDecoderOutput(**outputs)
    return ViaSDDecoderOnlyOutput(**outputs)


def generate_batch(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    config: ViaSDConfig,
    drafter: nn.Module | None,
    streamer: Any,
    check_invariants: bool,
    model_kwargs: dict[str, Any],
    translation: Translation | None = None,
) -> torch.Tensor | ViaSDDecoderOnlyOutput:
    """``viasd_generate`` for more than one prompt, or a drafter of another tokenizer: batched lossless VIA-SD, greedy
    or sampling (``viasd_hf.engine.batch``). Rows that finish early are padded with ``pad_token_id``, as ``generate``
    pads them; ``viasd_stats`` holds the totals and one ``ViaSDStats`` per row (``BatchViaSDStats``)."""
    check_batch_supported(model, input_ids, generation_config, drafter, streamer, stopping_criteria, model_kwargs)
    do_sample = bool(generation_config.do_sample)
    drafter = drafter_for_call(drafter, config, do_sample)
    masks = call_masks(model, config, generation_config, drafter)
    slim_mask = masks.slim.default_mask if isinstance(masks.slim, MaskSet) else masks.slim
    prompt_mask = model_kwargs.get("attention_mask")
    prompt_mask = torch.ones_like(input_ids) if prompt_mask is None else prompt_mask
    target_cache = RaggedCache(model.config, input_ids.shape[0], input_ids.device)
    lookup = prompt_lookup(model, generation_config, logits_processor)
    self_drafting = (model, masks.self_draft) if masks.self_draft is not None else None
    # a batch's slim tier decodes the whole vocabulary; a translated drafter, its own
    drafting_tiers = tuple(tier for tier in config.vocabulary_tiers if tier == "drafter" and translation is None)
    drafter_head, _ = tier_heads(config.vocabulary, model, drafter, _drafter_id(drafter), lookup is not None,
                                 drafting_tiers)
    reader = drafting_reader(drafter) if drafter is not None else None
    if translation is not None:
        chosen = translating_drafter(drafter, translation, lookup, config, target_cache, reader)
    else:
        chosen = batch_drafter(drafter, lookup, logits_processor, config.draft_confidence_threshold,
                               end_tokens(generation_config), target_cache, reader, self_drafting,
                               config.drafter_context, drafter_head)
    rng = RandomStream.from_global_seed() if do_sample else None  # every random draw of the call
    keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    decoder = BatchedDecoder(model, chosen, drafter, config, slim_mask, logits_processor, stopping_criteria,
                             generation_config.max_length, target_cache, rng, check_invariants, keep_scores, keep_logits)
    rows = decoder.run(input_ids, prompt_mask)
    pad = generation_config._pad_token_tensor
    pad = None if pad is None else int(pad.flatten()[0])
    sequences = rows.sequences(pad)
    if not generation_config.return_dict_in_generate:
        return sequences
    return ViaSDDecoderOnlyOutput(
        sequences=sequences,
        scores=rows.per_step("scores", pad) if keep_scores else None,
        logits=rows.per_step("logits", pad) if keep_logits else None,  # raw, from the tier that chose each token
        viasd_stats=decoder.stats,
    )


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
    tokenizer = kwargs.get("tokenizer")
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    for theirs, ours in (("assistant_model", "drafter"), ("streamer", "viasd_streamer"),
                         ("tokenizer", "viasd_tokenizer"), ("assistant_tokenizer", "drafter_tokenizer")):
        # generate hands a custom_generate callable none of these; idempotent, so that kwargs rewritten once
        # (enable_viasd on a mixin class) keep their drafter
        if kwargs.get(theirs) is not None:
            if kwargs.get(ours) is not None:
                raise ValueError(f"generate got both {theirs}= and {ours}=: pass one of them")
            kwargs[ours] = kwargs.pop(theirs)
    kwargs["viasd_config"] = viasd_config
    kwargs["custom_generate"] = viasd_generate
    return kwargs


class _Default:
    """``viasd_config`` not passed: ``enable_viasd``'s default applies (``viasd_config=None`` means plain)."""


def enabled_generate(
    *args: Any,
    model: nn.Module,
    viasd_default: ViaSDConfig | None,
    replaced: Any,
    viasd_config: ViaSDConfig | None | type[_Default] = _Default,
    **kwargs: Any,
) -> Any:
    """``model.generate`` after ``enable_viasd`` (bound with ``functools.partial``, as transformers binds a
    Hub ``custom_generate``): VIA-SD when there is a ``ViaSDConfig``, else what ``generate`` did before.

    A partial of a module-level function pickles, and ``deepcopy`` rebinds it to the copy.
    """
    config = viasd_default if viasd_config is _Default else viasd_config
    if config is None:
        return replaced(*args, **kwargs) if replaced is not None else type(model).generate(model, *args, **kwargs)
    return type(model).generate(model, *args, **viasd_generate_kwargs(config, kwargs))


def _binding(model: nn.Module) -> functools.partial | None:
    bound = model.__dict__.get("generate")
    return bound if isinstance(bound, functools.partial) and bound.func is enabled_generate else None


def enable_viasd(model: nn.Module, viasd_config: ViaSDConfig | None = None) -> nn.Module:
    """Give an already-loaded model VIA-SD ``generate`` (in place, returned for chaining).

    ``model.generate(..., viasd_config=...)`` then runs VIA-SD; without ``viasd_config`` it runs
    ``viasd_config`` given here (so pipelines use VIA-SD unchanged) or, if none, plain ``generate``.
    Only the instance's ``generate`` changes: class, config, saving and pickling are as before.
    ``disable_viasd`` undoes it.
    """
    previous = _binding(model)
    replaced = previous.keywords["replaced"] if previous is not None else model.__dict__.get("generate")
    model.generate = functools.partial(enabled_generate, model=model, viasd_default=viasd_config, replaced=replaced)
    return model


def disable_viasd(model: nn.Module) -> nn.Module:
    """Undo ``enable_viasd``: ``model.generate`` is again what it was before (in place, returned for chaining)."""
    binding = _binding(model)
    if binding is not None:
        del model.generate
        if binding.keywords["replaced"] is not None:
            model.generate = binding.keywords["replaced"]
    return model
