"""Plugging VIA-SD into ``model.generate``.

Three entry points, all ending in ``viasd_generate``, the ``custom_generate`` callable:

- ``model.generate(..., custom_generate=viasd_generate, drafter=..., viasd_config=...)``;
- ``ViaSDGenerationMixin`` for model classes, and ``enable_viasd(model)`` for a loaded model:
  afterwards ``model.generate(..., assistant_model=..., viasd_config=...)`` runs VIA-SD and a
  call without ``viasd_config`` is plain ``generate``.

``generate`` prepares logits processors, stopping criteria, lengths and attention masks, then
calls the callable — but forwards neither ``assistant_model`` nor ``streamer`` to it, so the
mixin and ``enable_viasd`` pass them under the callable's own names (docs/design.md, "Plugging into generate").

``enable_viasd`` binds ``generate`` on the instance, as transformers binds a Hub
``custom_generate``: the model's class, config, weights and pickling stay untouched.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import StaticCosts
from viasd_hf.control.hybrid_choice import CopyOrDraft
from viasd_hf.control.verdicts import VerdictStore
from viasd_hf.drafters.precision import drafted_as_given, drafter_for_call, drafting_reader
from viasd_hf.drafters.translating import translating_drafter
from viasd_hf.drafters.translation import drafter_translation
from viasd_hf.engine.batch import BatchedDecoder, RaggedCache, check_batch_supported
from viasd_hf.engine.batch.drafting import BatchAssistant, BatchDrafter, BatchHybrid, BatchLookup, BatchSelfDrafter
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.batch.model_drafts import Reader
from viasd_hf.engine.clock import call_clock
from viasd_hf.engine.preconditions import check_supported
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.engine.shards import Shards, from_rank_zero, shards_of
from viasd_hf.engine.stats import ViaSDStats
from viasd_hf.masks.architectures import is_encoder_decoder, model_config
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.resolver import CallMasks, masks_for_call
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.machine import emulated_bf16, machine_key
from viasd_hf.vocabulary.head import SubsetHead
from viasd_hf.vocabulary.lookup import drafter_vocabulary, resolve_vocabulary


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
    model: nn.Module, generation_config: GenerationConfig, processors: RowProcessors
) -> PromptLookupDrafter | None:
    """Prompt lookup copying ``prompt_lookup_num_tokens`` per draft (``None`` without it), each copy cut before a
    token the logits processors forbid and after an end token."""
    if not generation_config.prompt_lookup_num_tokens:
        return None
    vocab_size = model_config(model).get_text_config().vocab_size
    return PromptLookupDrafter(generation_config.prompt_lookup_num_tokens, processors, vocab_size,
                               end_tokens=end_tokens(generation_config))


def batch_drafter(assistant_model: nn.Module | None, lookup: PromptLookupDrafter | None,
                  processors: RowProcessors, confidence_threshold: float | None, end_tokens: frozenset[int],
                  target: RaggedCache, reader: Reader | None = None,
                  self_drafting: tuple[nn.Module, RoutingMask] | None = None, context: int | None = None,
                  head: SubsetHead | None = None, choice: CopyOrDraft | None = None) -> BatchDrafter:
    """The assistant model (reading the prompts through ``reader`` where there is one, at most ``context`` tokens of
    each), prompt lookup (``lookup``, each row copying from its own sequence), or both; without either, the target routed
    with its self-drafting mask (``self_drafting``: the model and the mask) on its cache ``target``. ``head``: the
    drafting model's LM head cut to a draft vocabulary; ``choice``: whether hybrid drafting copies (``BatchHybrid``)."""
    batch_lookup = BatchLookup(lookup) if lookup is not None else None
    if assistant_model is None:
        if batch_lookup is not None:
            return batch_lookup
        if self_drafting is None:
            raise ValueError("a batch needs a drafter: assistant_model=..., prompt_lookup_num_tokens=... or "
                             "ViaSDConfig(self_draft_mask=...)")
        return BatchSelfDrafter(*self_drafting, target, processors, confidence_threshold, end_tokens, head)
    rows, device = target.mask.shape[0], target.mask.device
    assistant = BatchAssistant(assistant_model, processors, confidence_threshold, end_tokens, rows, device, reader,
                               context, head)
    return assistant if batch_lookup is None else BatchHybrid(batch_lookup, assistant, choice)


def call_masks(
    model: nn.Module, config: ViaSDConfig, generation_config: GenerationConfig, drafter: nn.Module | None
) -> CallMasks:
    """The slim tier's mask and, when the target drafts for itself (no assistant, no prompt lookup), the self-drafter's
    (``resolver.masks_for_call``: a pair without a mask decodes without the slim tier, unless in tiered mode)."""
    return masks_for_call(
        model, _drafter_id(drafter), config.routing_mask, config.self_draft_mask, use_slim=config.use_slim,
        slim_required=config.mode == "tiered", self_drafts=drafter is None and not generation_config.prompt_lookup_num_tokens,
    )  # fmt: skip


def viasd_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    viasd_config: ViaSDConfig | None = None,
    drafter: nn.Module | None = None,
    viasd_streamer: BaseStreamer | None = None,
    viasd_check_invariants: bool = False,
    viasd_tokenizer: Any = None,
    drafter_tokenizer: Any = None,
    viasd_prompt_lookup_num_tokens: int | None = None,
    **model_kwargs: Any,
) -> torch.Tensor | ViaSDDecoderOnlyOutput | ViaSDEncoderDecoderOutput:
    """``custom_generate`` callable: VIA-SD decoding of every prompt of ``input_ids`` at once (one prompt is a batch
    of one), drafted by ``drafter`` (an assistant model), prompt lookup, both, or the target itself.

    ``generate`` hands a ``custom_generate`` callable neither its ``assistant_model`` nor its ``streamer``: called
    directly, pass them as ``drafter=`` and ``viasd_streamer=``; ``enable_viasd`` and ``ViaSDGenerationMixin`` do that
    for ``assistant_model=`` and ``streamer=`` (docs/design.md, "Plugging into generate"). A drafter of another
    tokenizer drafts through text (``viasd_tokenizer``, ``drafter_tokenizer``: ``generate``'s ``tokenizer`` and
    ``assistant_tokenizer``). Rows that finish early are padded with ``pad_token_id``, as ``generate`` pads them;
    ``viasd_stats`` holds the totals and one ``ViaSDStats`` per row (``BatchViaSDStats``).
    ``viasd_prompt_lookup_num_tokens``: ``generate``'s ``prompt_lookup_num_tokens``, passed under our own name so
    that ``generate`` does not take the call for its assisted generation (which refuses ``num_return_sequences``).
    """
    if viasd_prompt_lookup_num_tokens is not None:
        generation_config.prompt_lookup_num_tokens = viasd_prompt_lookup_num_tokens  # generate's copy, for this call
    config = ViaSDConfig.for_call(viasd_config)
    check_supported(model, input_ids, generation_config, model_kwargs, drafter)
    translation = drafter_translation(model, drafter, viasd_tokenizer, drafter_tokenizer, viasd_streamer)
    check_batch_supported(model, input_ids, generation_config, drafter, viasd_streamer, stopping_criteria, model_kwargs)
    do_sample = bool(generation_config.do_sample)
    shards = shards_of(model)  # a sharded target's ranks take rank 0's choices (docs/design.md, "Sharded targets")
    given, drafter = drafter, drafter_for_call(drafter, config, do_sample, shards)
    masks = from_rank_zero(shards, lambda: call_masks(model, config, generation_config, drafter))
    slim_mask = masks.slim.default_mask if isinstance(masks.slim, MaskSet) else masks.slim
    prompt_mask = None if is_encoder_decoder(model) else model_kwargs.get("attention_mask")  # the encoder's, there
    prompt_mask = torch.ones_like(input_ids) if prompt_mask is None else prompt_mask
    target_cache = RaggedCache(model_config(model), input_ids.shape[0], input_ids.device, model_kwargs.get("cache"),
                               encoder_inputs(model, model_kwargs))
    processors = RowProcessors(logits_processor, input_ids.shape[0])  # row by row, each in its place in the batch
    lookup = prompt_lookup(model, generation_config, processors)
    # a translated drafter drafts over its own whole vocabulary
    head = None if translation is not None else call_head(model, config, drafter, lookup is not None, shards)
    reader = drafting_reader(drafter) if drafter is not None else None
    if translation is not None:
        chosen = translating_drafter(drafter, translation, lookup, config, target_cache, reader)
    else:
        self_drafting = (model, masks.self_draft) if masks.self_draft is not None else None
        choice = None
        if drafter is not None and lookup is not None and config.knobs.adaptive:  # hybrid drafting copies where it pays
            choice = CopyOrDraft(StaticCosts.for_drafter(model, drafter, None).drafter)
        chosen = batch_drafter(drafter, lookup, processors, config.knobs.draft_confidence_threshold,
                               end_tokens(generation_config), target_cache, reader, self_drafting,
                               config.drafter_context, head, choice)
    rng = call_random_stream(shards) if do_sample else None  # every random draw of the call
    keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    decoder = BatchedDecoder(model, chosen, drafter, config, slim_mask, processors, stopping_criteria,
                             generation_config.max_length, target_cache, rng, viasd_check_invariants, keep_scores,
                             keep_logits, viasd_streamer, emulated_bf16(model), call_clock(model),
                             VerdictStore(machine_key))
    rows = decoder.run(input_ids, prompt_mask)
    drafted_as_given(given, drafter, decoder.stats, decoder.switch)
    pad = generation_config._pad_token_tensor
    pad = None if pad is None else int(pad.flatten()[0])
    sequences = rows.sequences(pad)
    if not generation_config.return_dict_in_generate:
        return sequences
    outputs = {
        "sequences": sequences,
        "scores": rows.per_step("scores", pad) if keep_scores else None,
        "logits": rows.per_step("logits", pad) if keep_logits else None,  # raw, from the tier that chose each token
        "viasd_stats": decoder.stats,
    }
    if is_encoder_decoder(model):
        return ViaSDEncoderDecoderOutput(**outputs)
    return ViaSDDecoderOnlyOutput(**outputs)


def call_head(model: nn.Module, config: ViaSDConfig, drafter: nn.Module | None, copies: bool,
              shards: Shards | None) -> SubsetHead | None:
    """The drafting model's LM head cut to the call's draft vocabulary (``drafter_vocabulary``; ``copies``: prompt
    lookup drafts), the vocabulary found by rank 0 on a sharded target: every rank must draft alike."""
    vocabulary = from_rank_zero(shards, lambda: resolve_vocabulary(config.vocabulary, model, _drafter_id(drafter)))
    return drafter_vocabulary(vocabulary, model, drafter, _drafter_id(drafter), copies)


def call_random_stream(shards: Shards | None) -> RandomStream:
    """The call's random numbers, seeded from torch's global generator (``RandomStream``). On a sharded target every
    rank draws its seed, so the global generators stay in step, and samples with rank 0's: ranks seeded apart would
    accept different drafts and run passes of different shapes."""
    seed = RandomStream.from_global_seed().seed
    return RandomStream(from_rank_zero(shards, lambda: seed))


def encoder_inputs(model: nn.Module, model_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """What every decoder pass of an encoder-decoder model feeds besides its tokens: the encoder output ``generate``
    computed once, and the encoder's attention mask; ``None`` for a decoder-only model."""
    if not is_encoder_decoder(model):
        return None
    return {"encoder_outputs": model_kwargs["encoder_outputs"], "attention_mask": model_kwargs.get("attention_mask")}


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
                         ("tokenizer", "viasd_tokenizer"), ("assistant_tokenizer", "drafter_tokenizer"),
                         ("prompt_lookup_num_tokens", "viasd_prompt_lookup_num_tokens")):
        # generate hands a custom_generate callable none of these (prompt lookup it would take for its own assisted
        # generation); idempotent, so that kwargs rewritten once (enable_viasd on a mixin class) keep their drafter
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
