"""The decoders ``viasd bench`` compares, each one callable that decodes one prompt and says what it did.

Every method decodes with the same target, the same generation settings and (where it drafts
with a model) the same drafter, so differences are the method's. HF's own decoders report no
acceptance statistics, so for them the counts come from the outside: a forward hook counts the
target's forwards and a wrapper on the candidate generator counts drafted tokens. VIA-SD's
variants report their own counts (``ViaSDStats``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from transformers.generation import candidate_generator

from viasd_hf.config import ViaSDConfig
from viasd_hf.engine.attention import fastest_attention
from viasd_hf.generation import enable_viasd
from viasd_hf.masks.routing_mask import RoutingMask

METHODS = (
    "greedy", "hf_assisted", "hf_prompt_lookup", "self_spec", "cascade", "two_tier", "viasd", "viasd_lossless",
    "two_tier_hybrid", "viasd_hybrid", "viasd_lossless_hybrid",
)
# HF assisted generation as users run it today, on the unquantised bf16 pair, next to methods on quantised models
UNQUANTIZED_REFERENCE = "hf_assisted_bf16"
# HF assisted generation with the attention kernel our decoders measure (viasd_hf.engine.attention): what that lever gives HF
STEERED_REFERENCE = "hf_assisted_fastattn"
# HF's universal assisted generation and lossless VIA-SD, drafting with a model of another tokenizer
# (MethodTable.other_drafter), so they run only when asked for
OTHER_TOKENIZER_METHODS = ("hf_assisted_other_tokenizer", "viasd_other_tokenizer")
KNOWN_METHODS = METHODS + OTHER_TOKENIZER_METHODS
HYBRID_SUFFIX = "_hybrid"  # the same method, drafting by prompt lookup where the context repeats itself
FLOAT32_TARGET_SUFFIX = "_fp32"
# One lever of our decoders switched off (or the target's precision changed), for an ablation side by side: append to any of our methods
# (after ``_hybrid``), e.g. ``viasd_lossless_hybrid_fullvocab``.
ABLATIONS = {
    "_fullvocab": "the drafter over the whole vocabulary (vocabulary=None)",
    "_nocost": "no cost model: the fixed draft rule and the slim tier always on (adaptive=False)",
    "_reproducible": "timings steer nothing: costs from weight sizes, every block speculates, the model's own attention "
                     "kernel, the drafter as loaded (reproducible=True)",
    "_fullprompt": "the drafter reads the whole prompt (drafter_context=None)",
    FLOAT32_TARGET_SUFFIX: "the target in float32, a copy beside the one loaded: where the CPU emulates bf16 it "
                           "verifies drafts natively",
}
OUR_METHODS = ("self_spec", "cascade", "two_tier", "viasd", "viasd_lossless", "viasd_other_tokenizer")


@dataclass(frozen=True)
class MethodName:
    """A bench method's name read as base decoder + prompt-lookup hybrid + ablated levers."""

    base: str
    hybrid: bool = False
    ablations: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str) -> MethodName | None:
        """The parts of ``name``, or ``None`` when it names no method (unknown base, repeated or misplaced suffix)."""
        ablations: list[str] = []
        while suffix := next((s for s in ABLATIONS if name.endswith(s) and s not in ablations), None):
            ablations.insert(0, suffix)
            name = name.removesuffix(suffix)
        hybrid = name.endswith(HYBRID_SUFFIX) and name.removesuffix(HYBRID_SUFFIX) in OUR_METHODS
        base = name.removesuffix(HYBRID_SUFFIX) if hybrid else name
        if base in (*KNOWN_METHODS, UNQUANTIZED_REFERENCE, STEERED_REFERENCE) and (base in OUR_METHODS or not ablations):
            return cls(base, hybrid, tuple(ablations))
        return None


def is_method(name: str) -> bool:
    return MethodName.parse(name) is not None


@dataclass
class Outcome:
    """One method on one prompt: the tokens it generated, how long it took, and who produced them.

    ``full_forwards`` counts the full target's forwards, prefill included (plain greedy: one per
    token). ``tier_tokens`` splits the generated tokens by producer: drafts that were kept
    (``drafter``), tokens the slim verifier produced itself (``slim``), and the full model's own
    corrections and bonus tokens (``full``).
    """

    tokens: list[int]
    seconds: float
    full_forwards: int
    drafted: int | None
    accepted: int | None
    tier_tokens: dict[str, int]
    viasd: dict[str, Any] | None = None


@dataclass
class MethodSettings:
    """What the compared methods share: the drafter's budget, and each baseline's one knob."""

    num_draft_tokens: int = 5
    draft_confidence_threshold: float | None = 0.4
    cascade_lenience: float = 0.3  # accepts what the full model rates within 1 − α = 0.7 of its favourite: VIA-SD's τ_acc
    prompt_lookup_tokens: int = 10
    drafter_context: int | None = ViaSDConfig.drafter_context

    def drafting(self) -> dict[str, Any]:
        return {"num_draft_tokens": self.num_draft_tokens, "draft_confidence_threshold": self.draft_confidence_threshold,
                "drafter_context": self.drafter_context}


Method = Callable[[torch.Tensor, dict[str, Any]], Outcome]


@dataclass
class _Counts:
    forwards: int = 0
    drafted: int = 0


@contextmanager
def _counting(target: nn.Module) -> Iterator[_Counts]:
    """Count the target's forwards and the tokens HF's candidate generators propose while inside."""
    counts = _Counts()
    hook = target.register_forward_pre_hook(lambda module, args: setattr(counts, "forwards", counts.forwards + 1))
    originals = {}
    for cls in (candidate_generator.AssistedCandidateGenerator, candidate_generator.PromptLookupCandidateGenerator,
                candidate_generator.AssistedCandidateGeneratorDifferentTokenizers,
                candidate_generator.UniversalSpeculativeDecodingGenerator):
        originals[cls] = cls.get_candidates

        def counted(self: Any, input_ids: torch.Tensor, *args: Any, _original: Any = cls.get_candidates, **kwargs: Any):
            candidates, logits = _original(self, input_ids, *args, **kwargs)
            counts.drafted += candidates.shape[1] - input_ids.shape[1]
            return candidates, logits

        cls.get_candidates = counted
    try:
        yield counts
    finally:
        hook.remove()
        for cls, original in originals.items():
            cls.get_candidates = original


def _hf_method(target: nn.Module, drafts: bool, steered: bool = False, **extra: Any) -> Method:
    """Plain ``generate`` (greedy / sampling) or one of HF's speculative modes, counted from outside; ``steered``: with
    short-query attention on the kernel measured fastest, as our decoders run it."""

    def run(ids: torch.Tensor, common: dict[str, Any]) -> Outcome:
        with _counting(target) as counts, fastest_attention((target, extra.get("assistant_model")), steered):
            started = time.perf_counter()
            out = target.generate(ids, **common, **extra)
            seconds = time.perf_counter() - started
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        accepted = len(tokens) - counts.forwards if drafts else None  # every target call adds one token of its own
        return Outcome(
            tokens=tokens,
            seconds=seconds,
            full_forwards=counts.forwards,
            drafted=counts.drafted if drafts else None,
            accepted=accepted,
            tier_tokens={"drafter": accepted or 0, "slim": 0, "full": len(tokens) - (accepted or 0)},
        )

    return run


def _viasd_method(target: nn.Module, config: ViaSDConfig, drafter: nn.Module | None, **extra: Any) -> Method:
    """A ``viasd_hf`` decode; its own statistics say who produced each token."""

    def run(ids: torch.Tensor, common: dict[str, Any]) -> Outcome:
        started = time.perf_counter()
        out = target.generate(ids, assistant_model=drafter, viasd_config=config, **common, **extra)
        seconds = time.perf_counter() - started
        stats = out.viasd_stats
        return Outcome(
            tokens=out.sequences[0, ids.shape[1] :].tolist(),
            seconds=seconds,
            full_forwards=stats.full_forwards,
            drafted=stats.drafted_tokens,
            accepted=stats.accepted_tokens,
            tier_tokens=dict(stats.committed_by),
            viasd=stats.to_dict(),
        )

    return run


@dataclass
class MethodTable:
    """Builds the requested methods for one target, drafter and pair of masks."""

    target: nn.Module
    drafter: nn.Module
    mask: RoutingMask
    self_draft_mask: RoutingMask | None
    settings: MethodSettings = field(default_factory=MethodSettings)
    unquantized: tuple[nn.Module, nn.Module] | None = None  # (target, drafter) in bf16, for UNQUANTIZED_REFERENCE
    float32_target: nn.Module | None = None  # the target in float32, for methods named with FLOAT32_TARGET_SUFFIX
    # OTHER_TOKENIZER_METHODS: a drafter of another tokenizer, the target's tokenizer and the drafter's
    other_drafter: tuple[nn.Module, Any, Any] | None = None

    def build(self, names: list[str]) -> dict[str, Method]:
        unknown = [name for name in names if not is_method(name)]
        if unknown:
            raise ValueError(f"unknown bench methods {unknown}; choose from {', '.join(KNOWN_METHODS)}, "
                             f"{UNQUANTIZED_REFERENCE}, {STEERED_REFERENCE}, with {HYBRID_SUFFIX} and "
                             f"{', '.join(ABLATIONS)} on ours")
        if UNQUANTIZED_REFERENCE in names and self.unquantized is None:
            raise ValueError(f"{UNQUANTIZED_REFERENCE} needs the unquantised pair (MethodTable.unquantized)")
        if names[0] != "greedy":
            raise ValueError("the first method must be 'greedy': every speed-up and agreement is measured against it")
        if "self_spec" in names and self.self_draft_mask is None:
            raise ValueError(
                "self_spec needs a self-drafting mask for this target: pass --self-draft-mask, or find one with "
                "`viasd search --drafter self --skip-ratio 0.45`, or leave self_spec out of --methods"
            )
        if self.float32_target is None and any(FLOAT32_TARGET_SUFFIX in MethodName.parse(name).ablations for name in names):
            raise ValueError(f"methods named with {FLOAT32_TARGET_SUFFIX} need the target in float32 (MethodTable.float32_target)")
        if self.other_drafter is None and set(OTHER_TOKENIZER_METHODS) & {MethodName.parse(name).base for name in names}:
            raise ValueError(f"{' and '.join(OTHER_TOKENIZER_METHODS)} need a drafter of another tokenizer: pass "
                             "--other-drafter, or leave them out")
        enable_viasd(self.target)
        return {name: self._method(name) for name in names}

    def _method(self, name: str) -> Method:
        method = MethodName.parse(name)
        if method.base in ("greedy", "hf_assisted", "hf_prompt_lookup", UNQUANTIZED_REFERENCE, STEERED_REFERENCE,
                           "hf_assisted_other_tokenizer"):
            return self._hf_baseline(name)
        config, drafter = self._viasd_setup(method.base)
        if "_fullvocab" in method.ablations:
            config = replace(config, vocabulary=None)
        if "_nocost" in method.ablations:
            config = replace(config, knobs=replace(config.knobs, adaptive=False))
        if "_reproducible" in method.ablations:
            config = replace(config, reproducible=True)
        if "_fullprompt" in method.ablations:
            config = replace(config, drafter_context=None)
        extra = {"prompt_lookup_num_tokens": self.settings.prompt_lookup_tokens} if method.hybrid else {}
        if method.base == "viasd_other_tokenizer":
            extra |= self._tokenizers()
        target = self.float32_target if FLOAT32_TARGET_SUFFIX in method.ablations else self.target
        return _viasd_method(enable_viasd(target), config, drafter, **extra)

    def _hf_baseline(self, name: str) -> Method:
        target, drafter = self.target, self.drafter
        if name == "greedy":
            return _hf_method(target, drafts=False)
        if name == "hf_assisted":
            return _hf_method(target, drafts=True, assistant_model=drafter)
        if name == "hf_assisted_other_tokenizer":
            return _hf_method(target, drafts=True, assistant_model=self.other_drafter[0], **self._tokenizers())
        if name == STEERED_REFERENCE:
            return _hf_method(target, drafts=True, steered=True, assistant_model=drafter)
        if name == UNQUANTIZED_REFERENCE:
            reference_target, reference_drafter = self.unquantized
            return _hf_method(reference_target, drafts=True, assistant_model=reference_drafter)
        return _hf_method(target, drafts=True, prompt_lookup_num_tokens=self.settings.prompt_lookup_tokens)

    def _tokenizers(self) -> dict[str, Any]:
        """What ``generate`` needs to draft with the drafter of another tokenizer (HF's names)."""
        _, tokenizer, drafter_tokenizer = self.other_drafter
        return {"tokenizer": tokenizer, "assistant_tokenizer": drafter_tokenizer}

    def _viasd_setup(self, name: str) -> tuple[ViaSDConfig, nn.Module | None]:
        """The config and drafter of one of our decoders (``self_spec`` drafts with the target itself)."""
        drafting = self.settings.drafting()
        lossless = {"mode": "lossless"}
        if name == "self_spec":
            return ViaSDConfig.paper(use_slim=False, self_draft_mask=self.self_draft_mask, **lossless, **drafting), None
        if name == "cascade":
            return ViaSDConfig.paper(use_slim=False, cascade_lenience=self.settings.cascade_lenience,
                                     **drafting), self.drafter
        if name == "two_tier":
            return ViaSDConfig.paper(use_slim=False, **lossless, **drafting), self.drafter
        if name == "viasd_other_tokenizer":  # lossless, with the target's routing mask for the slim tier
            return ViaSDConfig.paper(routing_mask=self.mask, **lossless, **drafting), self.other_drafter[0]
        if name == "viasd":
            # timings steer, so the slim tier runs wherever it pays on this machine; the default (nothing steered in
            # tiered mode) trades that for reproducible output
            return ViaSDConfig.paper(routing_mask=self.mask, reproducible=False, **drafting), self.drafter
        return ViaSDConfig.paper(routing_mask=self.mask, **lossless, **drafting), self.drafter
