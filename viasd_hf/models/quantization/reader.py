"""A quantised model's reader: the same weights dequantised once, for the passes that read many tokens at a time.

A 4-bit CPU kernel computes a linear layer from the packed weights on every pass. For the one to few tokens
of a drafting pass that is what makes 4 bits fast (a quarter of the bytes of bf16 to read); a pass over a
prompt is compute-bound, and there the kernel is slower than a bf16 matrix product, bitsandbytes' 4-bit and
torchao's int4 alike (docs/results.md, "Batches on an AMX Xeon" and "Batches on a Zen4"; ``bench/studies/batch_read``).
A drafter reads every prompt once per call (B of them in a batch) before it drafts, so a quantised drafting copy
reads through its twin (``dequantized_twin``) the passes over enough tokens: the same module tree,
each quantised linear layer replaced by a plain linear layer holding its weights dequantised, every other
module shared. The twin computes the model the quantised one computes (up to the rounding of a product), so
the cache it fills is the one the quantised model would have filled; a read by the bf16 model the copy was
made from (other weights) made the drafts worse (docs/results.md, "Batches on a Zen4"). The twin costs the
dequantised weights' memory: 2 bytes per weight of the linear layers, about 0.7 GB for a 0.5B drafter.

Where the twin starts to pay is the machine's (docs/results.md, "Batches on an AMX Xeon"). A batch's drafting pass
that feeds each row what it committed since its last draft carries tens of tokens, so the length is measured where
the twin is made (``fewest_tokens_for_twin``), not assumed (for a copy VIA-SD made, once per architecture, form and
machine: ``drafters.precision.FormNotes``).

Two kinds of quantised layer are dequantised: bitsandbytes' ``Linear4bit``, by bitsandbytes' own
``dequantize_4bit`` (before a first pass packs its weights for the CPU kernel), and a linear layer
whose weight is a torchao tensor, whose packed layout is the kernel's own. Where VIA-SD made the quantised
model from an unquantised one (``source``), a torchao int4 layer's weights are computed from the source's
as torchao's quantiser computed them (``_requantized``), and checked against the kernel on a few random rows;
otherwise the kernel itself computes them, as the product of the identity matrix with them. That product
costs as much as a pass over as many tokens as the layer has inputs: 11.2 s for the 0.5B drafter's twin on an
AMX Xeon, against 1.7 s from the source (the same weights).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from viasd_hf.extras import require


def dequantized_twin(model: nn.Module, source: nn.Module | None = None) -> nn.Module | None:
    """``model``'s twin whose quantised linear layers hold their weights dequantised; None where it has no such
    layer, or where a bitsandbytes layer's weights are in the CPU kernel's packed layout already (a first pass packs
    them). ``source``: the unquantised model ``model`` was made from, module for module (``measure.converted``)."""
    quantised = {module for module in model.modules() if _is_bnb_4bit(module) or _is_torchao_linear(module)}
    if not quantised or any(getattr(getattr(layer.weight, "quant_state", None), "packing_format_for_cpu", False)
                            for layer in quantised):  # fmt: skip
        return None
    names = {module: name for name, module in model.named_modules()}
    sources = dict(source.named_modules()) if source is not None else {}

    def twin(module: nn.Module) -> nn.Module:
        if module in quantised:
            return _dequantized(module, sources.get(names[module]))
        if not any(inner in quantised for inner in module.modules()):
            return module  # shared: nothing quantised inside
        made = copy.copy(module)  # its own dict of submodules; parameters, buffers and settings shared
        made._modules = {name: None if child is None else twin(child) for name, child in module._modules.items()}
        return made

    return twin(model)


READ_SIZES = (2, 4, 8, 16, 32, 64)  # tokens per pass timed for the twin and the quantised model, fewest first


@torch.no_grad()
def fewest_tokens_for_twin(model: nn.Module, twin: nn.Module, sizes: tuple[int, ...] = READ_SIZES,
                           clock: Callable[[], float] = time.perf_counter) -> int:
    """The fewest of ``sizes`` (tokens a pass carries, one sequence of them) from which ``twin`` runs a pass at least as
    fast as the quantised ``model`` on this machine; twice the largest where it never does (a prompt's read). Each
    size is timed on both, the median of three passes after a warm-up, starting from the middle size and walking
    down while the twin wins or up until it does (the twin's advantage grows with the tokens)."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, max(sizes)), generator=torch.Generator().manual_seed(0)).to(model.device)

    def median_seconds(module: nn.Module, tokens: int) -> float:
        module(ids[:, :tokens])  # warm-up: the first pass of a shape pays the kernels' setup
        times = []
        for _ in range(3):
            started = clock()
            module(ids[:, :tokens])
            times.append(clock() - started)
        return statistics.median(times)

    def twin_wins(index: int) -> bool:
        return median_seconds(twin, sizes[index]) <= median_seconds(model, sizes[index])

    index = len(sizes) // 2
    if twin_wins(index):
        while index > 0 and twin_wins(index - 1):
            index -= 1
        return sizes[index]
    for index in range(index + 1, len(sizes)):
        if twin_wins(index):
            return sizes[index]
    return 2 * max(sizes)


@torch.no_grad()
def _dequantized(layer: nn.Module, source: nn.Module | None) -> nn.Linear:
    """A plain linear layer computing what the quantised ``layer`` computes, its weights dequantised once (``source``:
    the unquantised layer it was made from, if known)."""
    if _is_bnb_4bit(layer):
        functional = require("bitsandbytes.functional", "quant", "a bitsandbytes model's reader")
        state = layer.weight.quant_state
        dtype = state.dtype
        weight = functional.dequantize_4bit(layer.weight.data, state).to(dtype)
        weight = weight.reshape(layer.out_features, layer.in_features)
    else:
        dtype = layer.weight.dtype
        weight = _requantized(layer, source) if source is not None else None
        if weight is None:  # its kernel applied to the identity matrix gives the weights it multiplies by, transposed
            identity = torch.eye(layer.in_features, dtype=dtype, device=layer.weight.device)
            weight = F.linear(identity, layer.weight).T.contiguous()
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        linear.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    return linear


# tolerance of the check in ``_requantized``: the kernel and a plain product round differently (well below this),
# while weights quantised otherwise (other groups, scales or zero points) are off by the quantisation error (above it)
REQUANTIZED_TOLERANCE = 1e-2


def _requantized(layer: nn.Module, source: nn.Module) -> torch.Tensor | None:
    """The weights a torchao int4 ``layer`` multiplies by, from the unquantised ``source`` layer it was made from:
    quantised as torchao's int4 configuration quantises them (tinygemm's asymmetric 4-bit groups along the inputs,
    zero points in the weights' dtype), dequantised in float32 and rounded to the layer's dtype. ``None`` where that
    is not what the kernel computes: another kind of tensor, a torchao without these functions, or products on four
    random rows that disagree with the kernel's."""
    quantised, weight = layer.weight, getattr(source, "weight", None)
    if (type(quantised).__name__ != "Int4OpaqueTensor" or getattr(quantised, "act_pre_scale", None) is not None
            or getattr(quantised, "act_mapping_type", None) is not None or weight is None
            or tuple(weight.shape) != tuple(quantised.shape)):  # fmt: skip
        return None
    try:
        from torchao.quantization.quant_primitives import (
            MappingType,
            _choose_qparams_affine_tinygemm,
            _dequantize_affine_tinygemm,
            _quantize_affine_tinygemm,
        )
    except ImportError:
        return None
    block, dtype = list(quantised.block_size), quantised.dtype
    weight = weight.detach().to(quantised.device, dtype)
    scale, zero = _choose_qparams_affine_tinygemm(weight, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                  None, dtype)
    values = _quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, 0, 15)
    weight = _dequantize_affine_tinygemm(values, block, scale, zero, torch.int32, 0, 15,
                                         output_dtype=torch.float32).to(dtype)
    rows = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, dtype)
    kernel, plain = F.linear(rows, quantised).float(), F.linear(rows.float(), weight.float())
    return weight if (kernel - plain).norm() <= REQUANTIZED_TOLERANCE * plain.norm() else None


# A layer of a quantising library can only exist once that library is imported, so these tests import nothing: a
# plain model's first call does not pay for importing bitsandbytes or torchao, nor show what they log as they load.


def _is_bnb_4bit(module: nn.Module) -> bool:
    nn_module = sys.modules.get("bitsandbytes.nn")
    return nn_module is not None and isinstance(module, nn_module.Linear4bit)


def _is_torchao_linear(module: nn.Module) -> bool:
    utils = sys.modules.get("torchao.utils")
    return utils is not None and isinstance(module, nn.Linear) and isinstance(module.weight, utils.TorchAOBaseTensor)
