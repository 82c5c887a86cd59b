"""The form a model runs in on CPU: unquantised (fp32, bf16, fp16) or quantised the way transformers users
already do it (``quantization_config=``), chosen by measuring on this machine.

:mod:`.schemes` names the forms, :mod:`.measure` times them next to bf16 and checks their agreement
with the float32 model, and :mod:`.choice` decides what ``auto`` means on this machine (and caches
why); for a drafter, :mod:`.drafting` decides it by how fast its target decodes with it.
:mod:`.invariance` measures whether a quantised scheme is batch-invariant here.
``python -m viasd_hf.models.quantization --model NAME [--draft-for TARGET]`` prints the table.
"""

from viasd_hf.models.quantization.choice import (
    Acceptance,
    QuantizationChoice,
    cached_measure,
    choose,
    choose_drafter,
    fastest_drafting_form,
    fastest_unquantized,
    markdown_table,
    resolve_drafting_form,
    resolve_dtype,
    resolve_quantization,
)
from viasd_hf.models.quantization.drafting import DraftingAcceptance
from viasd_hf.models.quantization.measure import Measurement, MeasureOptions, measure, measure_in_memory
from viasd_hf.models.quantization.schemes import (
    ALIASES,
    AUTO,
    BASELINE,
    FORMS,
    SCHEMES,
    UNQUANTIZED,
    QuantizationError,
    QuantizationUnavailableError,
    Scheme,
    get_scheme,
    scheme_names,
)

__all__ = [
    "ALIASES", "AUTO", "BASELINE", "FORMS", "SCHEMES", "UNQUANTIZED", "Acceptance", "DraftingAcceptance", "Measurement",
    "MeasureOptions", "QuantizationChoice", "QuantizationError", "QuantizationUnavailableError", "Scheme", "cached_measure",
    "choose", "choose_drafter", "fastest_drafting_form", "fastest_unquantized", "get_scheme", "markdown_table", "measure",
    "measure_in_memory", "resolve_drafting_form", "resolve_dtype", "resolve_quantization", "scheme_names",
]  # fmt: skip
