"""Measured cost of full, slim and drafter forward passes on this machine.

VIA-SD pays off only if a slim pass is cheap relative to a full one and the escalation rate
stays below that saving (docs/design.md, "The method"). Both the decoder's adaptive controller and DIMR's budget
sweep need the *measured* ratio: LM heads, attention over the cache and memory bandwidth make
it differ from the skipped fraction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.masks.architectures import num_decoder_layers, protected_layers
from viasd_hf.masks.layer_skipping import routed
from viasd_hf.masks.routing_mask import RoutingMask


def _context_cache(model: nn.Module, context: torch.Tensor):
    cache = new_cache(model.config)
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def forward_seconds(
    model: nn.Module,
    context_tokens: int = 300,
    block_tokens: tuple[int, ...] = (1, 6),
    masks: dict[str, RoutingMask | None] | None = None,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Median seconds of one forward of ``n`` new tokens over a KV cache of ``context_tokens``.

    ``masks`` maps a label to a routing mask (``None`` is the full model); all variants are
    timed interleaved, so machine load affects them alike. Returns ``{label: {n: seconds}}``.
    """
    masks = masks or {"full": None}
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (1, context_tokens), generator=generator)
    cache = _context_cache(model, context)
    samples: dict[str, dict[int, list[float]]] = {label: {n: [] for n in block_tokens} for label in masks}
    for repeat in range(repeats + 1):
        for n in block_tokens:
            block = torch.randint(0, vocab, (1, n), generator=generator)
            for label, mask in masks.items():
                scope: Callable = (lambda: routed(model, mask)) if mask is not None else nullcontext
                with scope():
                    started = time.perf_counter()
                    model(block, cache=cache, use_cache=True)
                    elapsed = time.perf_counter() - started
                crop_to(cache, context_tokens)
                if repeat:  # the first round warms up
                    samples[label][n].append(elapsed)
    return {label: {n: statistics.median(times) for n, times in per_n.items()} for label, per_n in samples.items()}


def cost_ratios(seconds: dict[str, dict[int, float]], reference: str = "full") -> dict[str, dict[int, float]]:
    """Each variant's time relative to the reference's single-token forward."""
    unit = seconds[reference][min(seconds[reference])]
    return {label: {n: t / unit for n, t in per_n.items()} for label, per_n in seconds.items()}


def evenly_spaced_skip(model: nn.Module, ratio: float) -> list[int]:
    """``round(ratio · L)`` unprotected layers spread over the depth: a cost probe, not a searched mask."""
    protected = protected_layers(model)
    candidates = [layer for layer in range(num_decoder_layers(model)) if layer not in protected]
    wanted = min(len(candidates), round(ratio * num_decoder_layers(model)))
    if wanted == 0:
        return []
    step = len(candidates) / wanted
    return [candidates[int(i * step)] for i in range(wanted)]
