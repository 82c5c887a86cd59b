"""``ViaSDConfig``: everything that shapes a VIA-SD decode, saved, shared and loaded like other HF configs.

``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` come from ``HubMixin``: a folder or a Hub
repo with ``viasd_config.json`` at its root (or in ``subfolder``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from viasd_hf.hub.mixin import HubMixin
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.validation import BOOL, INT, REAL, FieldType, check_fields, instance_of
from viasd_hf.vocabulary.store import DraftVocabulary

CONFIG_FILENAME = "viasd_config.json"
MODES = ("tiered", "lossless")
CONFIDENCE_SIGNALS = ("ratio", "probability")
TIER_SWITCHING = ("auto", "measured", "fixed")
ATTENTION_KERNELS = ("auto", "measured", "model")
VOCABULARY_TIERS = ("drafter", "slim")
DRAFTER_PRECISIONS = ("auto", "as_loaded")


_PATH = (str, os.PathLike, type(None))
_FIELD_TYPES = (
    (("num_draft_tokens", "max_slim_backlog"), INT),
    (("drafter_context",), INT.or_none()),
    (("use_slim", "adaptive", "runner_up", "plain_fallback"), BOOL),
    (("tau_accept", "tau_escalate"), REAL),
    (("draft_confidence_threshold", "cascade_lenience"), REAL.or_none()),
    (
        ("routing_mask",),
        instance_of(
            RoutingMask, MaskSet, *_PATH, expected="a RoutingMask, a MaskSet, a local path or Hub repo id (str), or None"
        ),
    ),
    (
        ("self_draft_mask",),
        instance_of(RoutingMask, *_PATH, expected="a RoutingMask, a local path or Hub repo id (str), or None"),
    ),
    (
        ("vocabulary",),
        instance_of(DraftVocabulary, *_PATH, expected='a DraftVocabulary, "auto", a local path or Hub repo id (str), or None'),
    ),
    (
        ("vocabulary_tiers",),
        FieldType(
            lambda tiers: isinstance(tiers, (tuple, list)) and all(isinstance(tier, str) for tier in tiers),
            "a tuple of tier names (str)",
        ),
    ),
)


@dataclass
class ViaSDConfig(HubMixin):
    """How the three tiers (drafter → slim verifier → full target) work together.

    Thresholds compare the slim verifier's confidence ``r`` in a draft token: accept when
    ``r > tau_accept``, regenerate with the slim verifier when ``tau_escalate < r <= tau_accept``,
    escalate to the full model when ``r <= tau_escalate``. Ties go to the more authoritative tier,
    so ``tau_accept = tau_escalate = 1.0`` hands every decision to the full model.

    ``cascade_lenience`` turns the full model's own verification into a speculative cascade
    (Narasimhan et al., "Faster Cascades via Speculative Decoding", token-specific deferral):
    a draft the full model finds within a factor ``1 − α`` of its favourite is kept. With
    ``use_slim=False`` this is the two-model cascade baseline ``viasd bench`` compares against.

    ``mode``: ``"lossless"`` (the default, as HF assisted generation) lets the full model verify every
    block, the slim tier only repairing drafts, so greedy output is ``generate``'s own and sampling draws
    from the target's distribution; ``"tiered"`` is the paper's (``ViaSDConfig.paper()``): tokens the slim
    tier accepts are final, so output may differ from ``generate``'s.

    ``tier_switching`` says how ``adaptive=True`` decides whether the slim tier runs. ``"measured"``:
    per block, on wall-clock timings remembered across calls on the model — fastest where the mask's
    offline prediction is wrong, but where that choice changes the output (tiered mode, sampling) the
    output depends on timing and can differ between identically seeded runs. ``"fixed"``: once per
    call, from the mask alone (tiered: on unless its DIMR record predicts no gain; lossless: off), so
    seeded calls are reproducible. ``"auto"``: ``"measured"`` where the choice cannot change the
    output (lossless greedy), ``"fixed"`` elsewhere. Draft lengths are planned from costs in every
    setting (``draft_planner``): measured costs under ``"measured"``, weight sizes otherwise.

    ``attention``: which kernel runs the short-query attention of drafting and verifying passes
    (``viasd_hf.engine.attention``). ``"measured"``: SDPA, the model's eager attention or SDPA over grouped
    queries, whichever is measured fastest on this machine (on CPU, SDPA is slow for a few query rows over a
    long cache, and copies the cache per query head under a mask); they round differently, so a sampling call's draws can then depend on timing. ``"model"``: the
    model's own kernel. ``"auto"``: ``"measured"`` where ``tier_switching`` measures, else ``"model"``.

    ``vocabulary``: a frequency-ranked draft vocabulary (``viasd_hf.vocabulary``) over which the tiers
    named in ``vocabulary_tiers`` (``"drafter"``, ``"slim"``) compute only those rows of the LM head.
    ``"auto"`` uses the pair's vocabulary when one is published or shipped beside its routing mask and
    fits the target, else the whole vocabulary; ``None`` is off; or a ``DraftVocabulary``, a folder or a
    Hub repo id. The full model always uses its whole head, so lossless mode is unchanged; the drafter's
    proposals are its softmax over the vocabulary (sampling stays exact), and the slim tier escalates a
    draft outside it.

    ``drafter_context``: an assistant model drafts from at most this many tokens of the prompt: its first
    few (the attention sinks, ``drafters.ATTENTION_SINK_TOKENS``) and the latest ones. Its prefill costs
    what its size says (a third of the target's for Qwen2.5 0.5B drafting for 1.5B) and is paid before
    the first token, so on long prompts with short answers (RAG) it is a large share of the call. Drafts from less context are accepted less often;
    verification is unchanged, so lossless output is too. ``None``: the whole prompt, as HF assisted
    generation.

    ``runner_up``: in greedy decoding a block the full model verifies also carries the drafter's second
    choice at the position where it is likeliest to be needed, as a leaf beside the draft in the same
    pass (``viasd_hf.engine.branching``); when the full model picks it, the block commits one token more.
    Output is unchanged: every committed token is still the full model's choice.

    ``plain_fallback``: where ``tier_switching`` measures, blocks decode one token plainly, without a
    draft, while speculating is measured slower on this machine, and speculation is probed now and then
    (``viasd_hf.control.speculation_switch``), so VIA-SD is not slower than plain decoding wherever speculation cannot pay.
    ``False`` speculates on every block, for instance to study a drafter.

    ``drafter_precision``: ``"auto"`` lets lossless greedy decoding draft with a copy of an assistant model
    in the unquantised form (fp32, bf16, fp16) measured fastest on this machine, made once per drafter
    (``viasd_hf.drafters.precision``); its precision cannot change lossless greedy output. ``"as_loaded"``
    drafts with the model as given, as tiered mode and sampling always do.
    """

    hub_filename = CONFIG_FILENAME
    hub_kind = "ViaSD config"
    hub_advice = "To get one: build a ViaSDConfig and save it with save_pretrained(DIR) or push_to_hub(REPO_ID)."

    num_draft_tokens: int = 5
    draft_confidence_threshold: float | None = 0.4  # adaptive=False: as HF assisted generation, stop drafting when unsure
    routing_mask: RoutingMask | MaskSet | str | None = None  # a MaskSet: the decoder chooses among its masks
    self_draft_mask: RoutingMask | str | None = None
    use_slim: bool = True
    confidence: str = "ratio"
    tau_accept: float = 0.7
    tau_escalate: float = 0.5
    mode: str = "lossless"  # as HF assisted generation: greedy output is generate's own; "tiered": the paper's (lossy)
    adaptive: bool = True  # slim tier only while it pays (measured online); draft lengths from a cost model
    tier_switching: str = "auto"  # adaptive=True: "measured" (wall clock), "fixed" (reproducible) or "auto" (see above)
    max_slim_backlog: int = 16  # tokens committed on the slim tier's authority before the full model must catch up
    cascade_lenience: float | None = None  # α: the full model keeps a draft d when q(d) > (1 − α)·max q (lossy)
    attention: str = "auto"  # short-query attention kernel: "measured", "model" or "auto" (see above)
    vocabulary: DraftVocabulary | str | None = "auto"  # see above: "auto", None, a DraftVocabulary, a path or repo id
    vocabulary_tiers: tuple[str, ...] = VOCABULARY_TIERS  # the tiers that decode over the vocabulary
    drafter_context: int | None = None  # see above: the most prompt tokens an assistant drafter reads; None: all
    runner_up: bool = True  # greedy: the full pass also verifies the drafter's second choice (see above)
    plain_fallback: bool = True  # decode plainly while speculation is measured slower (see above)
    drafter_precision: str = "auto"  # lossless greedy: draft in the fastest form measured here, or "as_loaded"

    def __post_init__(self) -> None:
        if isinstance(self.routing_mask, dict):
            is_set = "masks" in self.routing_mask
            self.routing_mask = (MaskSet if is_set else RoutingMask).from_dict(self.routing_mask)
        if isinstance(self.self_draft_mask, dict):
            self.self_draft_mask = RoutingMask.from_dict(self.self_draft_mask)
        if isinstance(self.vocabulary, dict):
            self.vocabulary = DraftVocabulary.from_dict(self.vocabulary)
        if isinstance(self.vocabulary_tiers, list):
            self.vocabulary_tiers = tuple(self.vocabulary_tiers)
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the first bad field.

        Runs when the config is built and again when ``generate`` uses it, so fields changed after
        construction are checked too.
        """
        check_fields(self, _FIELD_TYPES, "ViaSDConfig.{}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_confidence_threshold is not None and not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise ValueError(f"draft_confidence_threshold must lie in [0, 1), got {self.draft_confidence_threshold}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.tier_switching not in TIER_SWITCHING:
            raise ValueError(f"tier_switching must be one of {TIER_SWITCHING}, got {self.tier_switching!r}")
        if not self.adaptive and self.tier_switching != "auto":
            raise ValueError(
                f"tier_switching={self.tier_switching!r} needs adaptive=True: with adaptive=False the slim tier runs "
                "on every block"
            )
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.drafter_precision not in DRAFTER_PRECISIONS:
            raise ValueError(f"drafter_precision must be one of {DRAFTER_PRECISIONS}, got {self.drafter_precision!r}")
        if self.confidence not in CONFIDENCE_SIGNALS:
            raise ValueError(f"confidence must be one of {CONFIDENCE_SIGNALS}, got {self.confidence!r}")
        for name in ("tau_accept", "tau_escalate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.tau_accept < self.tau_escalate:
            raise ValueError(
                f"tau_accept ({self.tau_accept}) must be >= tau_escalate ({self.tau_escalate}): the slim verifier "
                "accepts above tau_accept, regenerates between the two and escalates below tau_escalate"
            )
        if self.cascade_lenience is not None:
            if not 0.0 <= self.cascade_lenience < 1.0:
                raise ValueError(f"cascade_lenience must lie in [0, 1), got {self.cascade_lenience}")
            if self.mode == "lossless":
                raise ValueError("cascade_lenience makes verification lossy; use mode='tiered' or cascade_lenience=None")
        unknown_tiers = [tier for tier in self.vocabulary_tiers if tier not in VOCABULARY_TIERS]
        if unknown_tiers:
            raise ValueError(f"vocabulary_tiers may name {VOCABULARY_TIERS}, got {list(self.vocabulary_tiers)}")
        if self.drafter_context is not None and self.drafter_context < 1:
            raise ValueError(f"drafter_context must be >= 1 (tokens) or None (the whole prompt), got {self.drafter_context}")
        if self.max_slim_backlog <= self.num_draft_tokens:
            raise ValueError(
                f"max_slim_backlog ({self.max_slim_backlog}) must exceed num_draft_tokens ({self.num_draft_tokens}): "
                "a slim block commits up to num_draft_tokens + 1 tokens"
            )

    @classmethod
    def for_call(cls, viasd_config: Any) -> ViaSDConfig:
        """The config a ``generate`` call runs with (the defaults when none was passed), validated again now."""
        if viasd_config is None:
            return cls()
        if not isinstance(viasd_config, cls):
            hint = ": build one with ViaSDConfig(**your_dict)" if isinstance(viasd_config, dict) else ""
            raise TypeError(f"viasd_config must be a ViaSDConfig, got {type(viasd_config).__name__}{hint}")
        viasd_config.validate()
        return viasd_config

    @classmethod
    def paper(cls, **overrides: Any) -> ViaSDConfig:
        """The paper's preset: tiered mode (tokens the slim tier accepts are final, so output may differ from
        ``generate``'s), α1 = 0.5, α2 = 0.3, i.e. τ_acc = 1 − α2, τ_esc = 1 − α1 (docs/design.md, "The method"), γ = 5."""
        alpha1, alpha2 = 0.5, 0.3
        preset = {"mode": "tiered", "tau_accept": 1 - alpha2, "tau_escalate": 1 - alpha1, "num_draft_tokens": 5}
        return cls(**preset | overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON can hold them: a ``Path`` given for a mask or vocabulary becomes its string."""
        return {name: os.fspath(value) if isinstance(value, os.PathLike) else value for name, value in asdict(self).items()}

    def to_json(self) -> str:
        """The ``viasd_config.json`` text: a ``RoutingMask`` is embedded, a path or Hub repo id kept as a string."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> ViaSDConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a ViaSD config must be a JSON object of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown ViaSDConfig fields {unknown}; is the config from a newer viasd_hf?")
        return cls(**data)
