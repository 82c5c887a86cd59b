"""Quantised formats a tier can be loaded in, and what ``from_pretrained`` needs for each.

A *scheme* names one quantised format: a ``BitsAndBytesConfig`` or ``TorchAoConfig`` for
``quantization_config=``, or, for PyTorch's deprecated dynamic quantisation (kept only so it can be
measured against the others), a transform after loading. ``int8`` and ``4bit`` are aliases for the
scheme measured best for that width on CPU (README, "Quantised tiers").
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

from viasd_hf.extras import MissingExtraError, require

AUTO = "auto"
TORCHAO = "torchao>=0.18"  # the release these schemes were measured with; the int4 config is a prototype there


class QuantizationError(ValueError):
    """An unknown scheme name, or a request that mixes ``quantization=`` with ``quantization_config=``."""


class QuantizationUnavailableError(MissingExtraError):
    """The library a scheme needs is not installed (``pip install 'viasd_hf[quant]'`` installs it)."""


def _bnb_4bit() -> Any:
    # NF4 with bf16 compute: bitsandbytes' fused CPU kernel (AVX512-BF16) takes bf16 activations only
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


class _FirstCastOnly(logging.Filter):
    """LLM.int8() logs the same "inputs will be cast" line on every matmul; let only the first through."""

    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("MatMul8bitLt: inputs will be cast"):
            return True
        first, _FirstCastOnly.seen = not _FirstCastOnly.seen, True
        return first


def _bnb_8bit() -> Any:
    cast_log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _FirstCastOnly) for f in cast_log.filters):
        cast_log.addFilter(_FirstCastOnly())
    return BitsAndBytesConfig(load_in_8bit=True)


def _torchao(config_name: str, module: str = "torchao.quantization", **options: Any) -> Callable[[], Any]:
    def build() -> Any:
        from transformers import TorchAoConfig

        config_class = getattr(require(module, "quant", f"quantization config {config_name}"), config_name)
        return TorchAoConfig(config_class(**options))

    return build


def _torch_dynamic_int8(model: PreTrainedModel) -> PreTrainedModel:
    """The decoder's linear layers, in place; the output head stays a float ``nn.Linear``, like the other schemes."""
    from torch.ao.quantization import quantize_dynamic

    quantize_dynamic(model.get_decoder(), {nn.Linear}, dtype=torch.qint8, inplace=True)
    return model


@dataclass(frozen=True)
class Scheme:
    """One format: what ``from_pretrained`` needs to load a model in it, and which library provides it."""

    name: str
    bits: int
    library: str  # the module whose absence makes the scheme unavailable
    requirement: str  # what to ``pip install`` for it
    dtype: torch.dtype  # of the parts left unquantised (embeddings, norms) and of the activations
    summary: str
    make_config: Callable[[], Any] | None = None  # the ``quantization_config``
    transform: Callable[[PreTrainedModel], PreTrainedModel] | None = None  # applied after loading

    @property
    def available(self) -> bool:
        return importlib.util.find_spec(self.library) is not None

    def require(self) -> None:
        """Import the scheme's library (quietly: bitsandbytes and torchao log as they load), or raise
        :class:`QuantizationUnavailableError` naming the extra that installs it."""
        try:
            require(self.library, "quant", f"quantization scheme {self.name!r}")
        except MissingExtraError as error:
            raise QuantizationUnavailableError(str(error)) from error.__cause__

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``from_pretrained`` needs (``dtype`` is left to the caller)."""
        self.require()
        return {"quantization_config": self.make_config()} if self.make_config else {}

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        return self.transform(model) if self.transform else model


BASELINE = Scheme("bf16", 16, "torch", "torch", torch.bfloat16, "unquantised bfloat16: the speed baseline")
UNQUANTIZED: dict[str, Scheme] = {
    s.name: s
    for s in (Scheme("fp32", 32, "torch", "torch", torch.float32, "unquantised float32"), BASELINE,
              Scheme("fp16", 16, "torch", "torch", torch.float16, "unquantised float16"))
}  # fmt: skip

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("bnb-4bit", 4, "bitsandbytes", "bitsandbytes>=0.45", torch.bfloat16,
               "bitsandbytes NF4 weights, bfloat16 compute", make_config=_bnb_4bit),
        Scheme("bnb-8bit", 8, "bitsandbytes", "bitsandbytes>=0.45", torch.bfloat16,
               "bitsandbytes LLM.int8() weights, fp16 outlier columns chosen per pass", make_config=_bnb_8bit),
        Scheme("torchao-int8", 8, "torchao", TORCHAO, torch.bfloat16,
               "torchao int8 weights, per-token dynamic int8 activations",
               make_config=_torchao("Int8DynamicActivationInt8WeightConfig")),
        Scheme("torchao-int8-weight-only", 8, "torchao", TORCHAO, torch.bfloat16,
               "torchao int8 weights, bfloat16 activations", make_config=_torchao("Int8WeightOnlyConfig")),
        Scheme("torchao-int4-weight-only", 4, "torchao", TORCHAO, torch.bfloat16,
               "torchao int4 weights (groups of 128, CPU-packed; a torchao prototype), bfloat16 activations",
               make_config=_torchao("PrototypeInt4WeightOnlyConfig", "torchao.prototype.quantization.int4",
                                    group_size=128)),
        Scheme("torch-dynamic-int8", 8, "torch", "torch", torch.float32,
               "torch.ao quantize_dynamic (deprecated API): int8 weights, per-tensor dynamic int8 activations",
               transform=_torch_dynamic_int8),
    )  # fmt: skip
}

FORMS: dict[str, Scheme] = UNQUANTIZED | SCHEMES  # every form a model can be measured in

# The width aliases name the scheme measured best for that width on CPU (README, "Quantised tiers").
ALIASES: dict[str, str] = {"int8": "torchao-int8", "4bit": "bnb-4bit"}


def scheme_names() -> list[str]:
    """Every name ``quantization=`` accepts."""
    return [*SCHEMES, *ALIASES, AUTO]


def load_in(source: Any, scheme: Scheme | None, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The model at ``source`` in ``scheme``, in eval mode; ``scheme`` None: unquantised, in ``dtype`` (float32,
    the reference, by default)."""
    if scheme is None:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=scheme.dtype, **scheme.from_pretrained_kwargs()).eval()
    return scheme.finish(model)


def get_scheme(name: str) -> Scheme:
    """The scheme a name or alias stands for (not ``auto``, which needs a model to measure)."""
    key = ALIASES.get(name, name)
    if key not in SCHEMES:
        raise QuantizationError(f"unknown quantization scheme {name!r}; valid names: {', '.join(scheme_names())}")
    return SCHEMES[key]
