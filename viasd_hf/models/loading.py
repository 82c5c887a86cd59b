"""Loading a model and its tokenizer the way the rest of viasd_hf expects: zoo names, dtypes, quantised tiers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from viasd_hf.models.quantization import QuantizationError, resolve_dtype, resolve_quantization
from viasd_hf.models.zoo import ZOO, resolve_zoo_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: torch.dtype | str | None, name_or_path: str) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return resolve_dtype(name_or_path).scheme.dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use a torch.dtype or one of {[*_DTYPES, 'auto']}")


def load_pretrained(
    name_or_path: str,
    dtype: torch.dtype | str | None = None,
    quantization: str | None = None,
    draft_for: str | None = None,
    **kwargs,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a zoo name, a local folder or a Hub id.

    ``dtype`` defaults to float32 (CPU-friendly and exact for the dequantized zoo
    weights), or to the quantization scheme's own dtype; ``"auto"`` is float32 or
    bfloat16, whichever this machine runs the model faster in (measured once, then cached:
    :func:`viasd_hf.models.quantization.resolve_dtype`; docs/quantization.md); ``quantization`` names a
    scheme of :mod:`viasd_hf.models.quantization` (e.g. ``"bnb-4bit"``), an alias
    (``"int8"``, ``"4bit"``) or ``"auto"`` (the fastest scheme measured on this
    machine whose agreement with the unquantised model is acceptable; with ``draft_for``, the
    target this model drafts for, the scheme with which that target decodes fastest).
    ``kwargs`` (``device_map``, ``quantization_config``, ...) go to
    ``from_pretrained``.  Zoo models keep their zoo name as ``config._name_or_path``
    so anything keyed on the target id (e.g. routing masks) does not depend on
    where the cache lives.
    """
    is_zoo = name_or_path in ZOO and not Path(name_or_path).is_dir()
    source = resolve_zoo_model(name_or_path) if is_zoo else name_or_path
    scheme = None
    if quantization is not None:
        if "quantization_config" in kwargs:
            raise QuantizationError("pass either quantization= (a scheme name) or quantization_config=, not both")
        scheme = resolve_quantization(name_or_path, quantization, draft_for=draft_for).scheme
        kwargs = scheme.from_pretrained_kwargs() | kwargs
        dtype = scheme.dtype if dtype in (None, "auto") else dtype
    model = AutoModelForCausalLM.from_pretrained(source, dtype=_as_dtype(dtype, name_or_path), **kwargs)
    if scheme is not None:
        model = scheme.finish(model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if is_zoo:
        model.config._name_or_path = name_or_path
    return model, tokenizer
