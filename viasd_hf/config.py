"""``ViaSDConfig``: everything that shapes a VIA-SD decode, saved, shared and loaded like other HF configs; the
paper's settings grouped in ``PaperKnobs``.

``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` come from ``HubMixin``: a folder or a Hub
repo with ``viasd_config.json`` at its root (or in ``subfolder``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from viasd_hf.hub.mixin import HubMixin
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.validation import BOOL, INT, REAL, check_fields, instance_of
from viasd_hf.vocabulary.store import DraftVocabulary

CONFIG_FILENAME = "viasd_config.json"
MODES = ("tiered", "lossless")
CONFIDENCE_SIGNALS = ("ratio", "probability")
# fields of earlier configs that went: a saved config holding one loads with a warning naming it
GONE_FIELDS = {
    "tier_switching": "reproducible replaces it ('fixed': True, 'measured': False, 'auto': None)",
    "attention": "reproducible decides it: the kernel is measured unless reproducible=True",
    "plain_fallback": "reproducible decides it: plain decoding is measured unless reproducible=True",
    "drafter_precision": "reproducible decides it: the drafter's form is measured unless reproducible=True",
    "runner_up": "the runner-up leaf was removed (it measured within noise)",
    "vocabulary_tiers": "only the drafter decodes over a draft vocabulary",
}
_REPRODUCIBLE_FROM = {"fixed": True, "measured": False, "auto": None}  # tier_switching's values
logger = logging.getLogger("viasd_hf")

_PATH = (str, os.PathLike, type(None))
_KNOB_TYPES = (
    (("num_draft_tokens", "max_slim_backlog"), INT),
    (("adaptive",), BOOL),
    (("tau_accept", "tau_escalate"), REAL),
    (("draft_confidence_threshold", "cascade_lenience"), REAL.or_none()),
    (("confidence",), instance_of(str, expected="a string")),
)
@dataclass
class PaperKnobs:
    """The paper's settings: the slim verifier's gate, the draft length and how far the slim tier may run ahead.

    Thresholds compare the slim verifier's confidence ``r`` in a draft token (``confidence``: ``"ratio"``,
    its probability over its favourite's, or ``"probability"``): accept when ``r > tau_accept``, regenerate
    with the slim verifier when ``tau_escalate < r <= tau_accept``, escalate to the full model when
    ``r <= tau_escalate``. Ties go to the more authoritative tier, so ``tau_accept = tau_escalate = 1.0``
    hands every decision to the full model.

    ``adaptive=True`` (the default) measures while decoding whether the slim tier pays and plans each draft's
    length from costs (docs/design.md, "Deciding online"); ``adaptive=False`` runs the paper's fixed rule:
    the slim tier on every block and ``num_draft_tokens`` per draft, ending early below
    ``draft_confidence_threshold``, as HF assisted generation. ``max_slim_backlog``: tokens committed on the
    slim tier's authority before the full model must catch up (tiered mode).

    ``cascade_lenience`` α turns the full model's verification into a speculative cascade (Narasimhan et al.,
    "Faster Cascades via Speculative Decoding"): a draft within a factor ``1 − α`` of its favourite is kept
    (lossy: tiered mode only).
    """

    tau_accept: float = 0.7
    tau_escalate: float = 0.5
    confidence: str = "ratio"
    num_draft_tokens: int = 5
    max_slim_backlog: int = 16
    adaptive: bool = True
    draft_confidence_threshold: float | None = 0.4
    cascade_lenience: float | None = None

    def validate(self) -> None:
        """Raise ``TypeError`` or ``ValueError`` naming the first bad knob."""
        check_fields(self, _KNOB_TYPES, "PaperKnobs.{}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_confidence_threshold is not None and not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise ValueError(f"draft_confidence_threshold must lie in [0, 1), got {self.draft_confidence_threshold}")
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
        if self.cascade_lenience is not None and not 0.0 <= self.cascade_lenience < 1.0:
            raise ValueError(f"cascade_lenience must lie in [0, 1), got {self.cascade_lenience}")
        if self.max_slim_backlog <= self.num_draft_tokens:
            raise ValueError(
                f"max_slim_backlog ({self.max_slim_backlog}) must exceed num_draft_tokens ({self.num_draft_tokens}): "
                "a slim block commits up to num_draft_tokens + 1 tokens"
            )

    @classmethod
    def from_dict(cls, data: Any) -> PaperKnobs:
        if not isinstance(data, dict):
            raise ValueError(f"ViaSDConfig.knobs must be a JSON object of knobs, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown PaperKnobs fields {unknown}; is the config from a newer viasd_hf?")
        return cls(**data)


_FIELD_TYPES = (
    (("drafter_context",), INT.or_none()),
    (("use_slim",), BOOL),
    (("reproducible",), BOOL.or_none()),
    (("knobs",), instance_of(PaperKnobs, expected="a PaperKnobs")),
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
)


@dataclass
class ViaSDConfig(HubMixin):
    """How the three tiers (drafter → slim verifier → full target) work together: what a user sets.

    ``mode``: ``"lossless"`` (the default, as HF assisted generation) lets the full model verify every
    block, the slim tier only repairing drafts, so greedy output is ``generate``'s own and sampling draws
    from the target's distribution; ``"tiered"`` is the paper's (``ViaSDConfig.paper()``): tokens the slim
    tier accepts are final, so output may differ from ``generate``'s.

    ``routing_mask``: the layers the slim verifier keeps (a ``RoutingMask``; a ``MaskSet`` decodes with its
    default mask; a folder or Hub repo id); ``None``: the pair's mask where one is known. ``self_draft_mask``:
    the heavier mask the target drafts for itself with, where there is no other drafter; ``None``: the pair's,
    or a mask by rule. ``use_slim=False`` runs two tiers (drafter and full model): standard speculative decoding.

    ``vocabulary``: a frequency-ranked draft vocabulary (``viasd_hf.vocabulary``) over which the drafting
    model computes only those rows of its LM head. ``"auto"`` uses the pair's vocabulary when one is
    published or shipped beside its routing mask and fits the target; ``None`` is off; or a
    ``DraftVocabulary``, a folder or a Hub repo id. The slim tier and the full model always use the whole
    head; the drafter's proposals are its softmax over the vocabulary, so sampling stays exact.

    ``drafter_context``: an assistant model drafts from at most this many tokens of the prompt: its first
    few (the attention sinks, ``engine.batch.model_drafts.ATTENTION_SINK_TOKENS``) and the latest ones, so that on long
    prompts with short answers its prefill does not dominate the call. Verification is unchanged, so
    lossless output is too. ``None``: the whole prompt, as HF assisted generation.

    ``reproducible``: whether timings may steer the choices that speed depends on — whether the slim tier
    runs, the draft lengths' costs, plain decoding where speculation does not pay, the attention kernel, the
    drafter's precision (docs/design.md, "Deciding online"). ``None`` (the default): timings steer exactly
    where they cannot change the output (lossless greedy decoding), elsewhere everything runs the fixed way.
    ``True``: everything runs the fixed way (costs from weight sizes, every block speculates), so a seeded
    call repeats exactly, path included. ``False``: timings steer everywhere, fastest, but in tiered mode
    and when sampling the output then depends on timing.

    ``knobs``: the paper's settings (its thresholds, draft length, slim backlog; ``PaperKnobs``), set
    through ``ViaSDConfig.paper(...)``.
    """

    hub_filename = CONFIG_FILENAME
    hub_kind = "ViaSD config"
    hub_advice = "To get one: build a ViaSDConfig and save it with save_pretrained(DIR) or push_to_hub(REPO_ID)."

    mode: str = "lossless"  # as HF assisted generation: greedy output is generate's own; "tiered": the paper's (lossy)
    routing_mask: RoutingMask | MaskSet | str | None = None
    self_draft_mask: RoutingMask | str | None = None
    use_slim: bool = True
    vocabulary: DraftVocabulary | str | None = "auto"  # see above: "auto", None, a DraftVocabulary, a path or repo id
    drafter_context: int | None = None  # see above: the most prompt tokens an assistant drafter reads; None: all
    reproducible: bool | None = None  # see above: may timings steer? None: only where the output cannot change
    knobs: PaperKnobs = field(default_factory=lambda: PaperKnobs())

    def __post_init__(self) -> None:
        if isinstance(self.routing_mask, dict):
            is_set = "masks" in self.routing_mask
            self.routing_mask = (MaskSet if is_set else RoutingMask).from_dict(self.routing_mask)
        if isinstance(self.self_draft_mask, dict):
            self.self_draft_mask = RoutingMask.from_dict(self.self_draft_mask)
        if isinstance(self.vocabulary, dict):
            self.vocabulary = DraftVocabulary.from_dict(self.vocabulary)
        if isinstance(self.knobs, dict):
            self.knobs = PaperKnobs.from_dict(self.knobs)
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the first bad field.

        Runs when the config is built and again when ``generate`` uses it, so fields changed after
        construction are checked too.
        """
        check_fields(self, _FIELD_TYPES, "ViaSDConfig.{}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.drafter_context is not None and self.drafter_context < 1:
            raise ValueError(f"drafter_context must be >= 1 (tokens) or None (the whole prompt), got {self.drafter_context}")
        self.knobs.validate()
        if self.knobs.cascade_lenience is not None and self.mode == "lossless":
            raise ValueError("cascade_lenience makes verification lossy; use mode='tiered' or cascade_lenience=None")

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
        ``generate``'s), α1 = 0.5, α2 = 0.3, i.e. τ_acc = 1 − α2, τ_esc = 1 − α1 (docs/design.md, "The method"), γ = 5.

        ``overrides`` name fields of the config (``mode="lossless"``, ``routing_mask=...``) or of ``PaperKnobs``
        (``tau_accept=0.8``, ``num_draft_tokens=4``, ``adaptive=False``)."""
        alpha1, alpha2 = 0.5, 0.3
        knob_names = {f.name for f in fields(PaperKnobs)}
        knobs = {"tau_accept": 1 - alpha2, "tau_escalate": 1 - alpha1, "num_draft_tokens": 5}
        knobs |= {name: value for name, value in overrides.items() if name in knob_names}
        settings = {"mode": "tiered"} | {name: value for name, value in overrides.items() if name not in knob_names}
        return cls(**settings, knobs=PaperKnobs(**knobs))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON can hold them: a ``Path`` given for a mask or vocabulary becomes its string."""
        return {name: os.fspath(value) if isinstance(value, os.PathLike) else value for name, value in asdict(self).items()}

    def to_json(self) -> str:
        """The ``viasd_config.json`` text: a ``RoutingMask`` is embedded, a path or Hub repo id kept as a string."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read_beside(cls, data: Any, folder: Path) -> Any:
        """A mask or vocabulary a saved config names by a relative path is read beside the config, not from the
        loader's working folder; a Hub repo id, which names nothing there, stays as it is."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in ("routing_mask", "self_draft_mask", "vocabulary"):
            value = data.get(name)
            if isinstance(value, str) and not Path(value).is_absolute() and (folder / value).exists():
                data[name] = str(folder / value)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ViaSDConfig:
        """The config a saved ``viasd_config.json`` describes. A config saved by an earlier viasd_hf loads too: the
        paper's settings it kept beside the others move into ``knobs``, and each field that went is named in one
        warning line and dropped (``tier_switching`` becomes ``reproducible``)."""
        if not isinstance(data, dict):
            raise ValueError(f"a ViaSD config must be a JSON object of fields, got {type(data).__name__}")
        data = dict(data)
        knob_names = {f.name for f in fields(PaperKnobs)}
        moved = {name: data.pop(name) for name in list(data) if name in knob_names}
        if moved:
            data["knobs"] = PaperKnobs.from_dict((data.get("knobs") or {}) | moved)
        for name in [name for name in data if name in GONE_FIELDS]:
            value = data.pop(name)
            if name == "tier_switching" and value in _REPRODUCIBLE_FROM and "reproducible" not in data:
                data["reproducible"] = _REPRODUCIBLE_FROM[value]
            logger.warning("ViaSDConfig: dropped the saved field %s=%r: %s", name, value, GONE_FIELDS[name])
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown ViaSDConfig fields {unknown}; is the config from a newer viasd_hf?")
        return cls(**data)
