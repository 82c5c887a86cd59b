"""A 4-bit model's reader: the same weights dequantised once, for the passes that read many tokens at a time.

bitsandbytes' CPU kernel computes a 4-bit linear layer from the packed weights on every pass. For the
one to few tokens of a drafting pass that is what makes 4 bits fast (half the bytes of bf16 to read);
a pass over a prompt is compute-bound, and there the kernel is slower than a bf16 matrix product: the
4-bit Qwen2.5-Coder 0.5B read 256 tokens in 0.90 s where its bf16 model took 0.65 s (AMD EPYC Zen4,
AVX512-BF16, two threads). A drafter reads every prompt once per call (B of them in a batch) before it
drafts, so a 4-bit drafting copy reads through its twin (``dequantized_twin``) the passes over
``drafters.model.LONG_READ`` tokens and more: the same module tree, each 4-bit linear layer replaced
by a plain linear layer holding its weights dequantised, every other module shared. The twin
computes the model the 4-bit one computes (up to the rounding of a product), so the cache it fills is
the one the 4-bit model would have filled; a read by the bf16 model the copy was made from (other
weights) made the drafts worse (docs/results.md, "Batches"). The twin costs the dequantised weights'
memory: 2 bytes per weight of the linear layers, about 0.7 GB for a 0.5B drafter.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def dequantized_twin(model: nn.Module) -> nn.Module | None:
    """``model``'s twin whose bitsandbytes 4-bit linear layers hold their weights dequantised; None where it has no
    such layer, or where a layer's weights are in the CPU kernel's packed layout already (a first pass packs them)."""
    try:
        from bitsandbytes.functional import dequantize_4bit
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return None
    layers = [module for module in model.modules() if isinstance(module, Linear4bit)]
    if not layers or any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers):
        return None

    def twin(module: nn.Module) -> nn.Module:
        if isinstance(module, Linear4bit):
            return dequantized(module, dequantize_4bit)
        if not any(isinstance(inner, Linear4bit) for inner in module.modules()):
            return module  # shared: nothing 4-bit inside
        made = copy.copy(module)  # its own dict of submodules; parameters, buffers and settings shared
        made._modules = {name: None if child is None else twin(child) for name, child in module._modules.items()}
        return made

    return twin(model)


@torch.no_grad()
def dequantized(layer: nn.Module, dequantize_4bit) -> nn.Linear:
    """A plain linear layer computing what the 4-bit ``layer`` computes, its weights dequantised once."""
    state = layer.weight.quant_state
    weight = dequantize_4bit(layer.weight.data, state).to(state.dtype).reshape(layer.out_features, layer.in_features)
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        linear.bias = nn.Parameter(layer.bias.detach().to(state.dtype), requires_grad=False)
    return linear
