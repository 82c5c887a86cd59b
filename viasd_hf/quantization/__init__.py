"""Quantised tiers on CPU, loaded the way transformers users already do it (``quantization_config=``).

:mod:`.schemes` names the formats, :mod:`.measure` times them next to bf16 and checks their
agreement with the float32 model, and :mod:`.choice` decides what ``auto`` means on this machine
(and caches why); for a drafter, :mod:`.drafting` decides it by how fast its target decodes with
it. ``python -m viasd_hf.quantization --model NAME [--draft-for TARGET]`` prints the table.
"""

from .choice import (
    Acceptance,
    QuantizationChoice,
    cached_measure,
    choose,
    choose_drafter,
    markdown_table,
    resolve_quantization,
)
from .drafting import DraftingAcceptance
from .measure import Measurement, MeasureOptions, measure
from .schemes import (
    ALIASES,
    AUTO,
    BASELINE,
    SCHEMES,
    QuantizationError,
    QuantizationUnavailableError,
    Scheme,
    get_scheme,
    scheme_names,
)

__all__ = [
    "ALIASES", "AUTO", "BASELINE", "SCHEMES", "Acceptance", "DraftingAcceptance", "Measurement", "MeasureOptions", "QuantizationChoice",
    "QuantizationError", "QuantizationUnavailableError", "Scheme", "cached_measure", "choose", "choose_drafter", "get_scheme",
    "markdown_table", "measure", "resolve_quantization", "scheme_names",
]  # fmt: skip
