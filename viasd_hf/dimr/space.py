"""DIMR's search space (which layers may be skipped, and how many) and the baseline masks drawn from it.

A candidate skips exactly k = round(s·L) of the skippable layers; ``architectures.protected_layers``
are always kept. The random and early-exit masks at the same k are what a searched mask is
compared against (``report.compare_with_baselines``).
"""

from __future__ import annotations

import math
import random

from torch import nn

from viasd_hf.masks.architectures import num_decoder_layers, protected_layers
from viasd_hf.masks.routing_mask import RoutingMask


def skippable_layers(model: nn.Module) -> list[int]:
    """Layers a routing mask may skip: all but ``protected_layers``."""
    protected = protected_layers(model)
    return [layer for layer in range(num_decoder_layers(model)) if layer not in protected]


def skip_count(model: nn.Module, skip_ratio: float) -> int:
    """k = round(s·L) (halves round up), checked against the number of skippable layers."""
    k = math.floor(skip_ratio * num_decoder_layers(model) + 0.5)
    available = len(skippable_layers(model))
    if not 1 <= k <= available:
        raise ValueError(
            f"skip ratio {skip_ratio} means skipping {k} of {num_decoder_layers(model)} layers; "
            f"between 1 and {available} can be skipped on this model"
        )
    return k


def random_masks(model: nn.Module, k: int, n: int, seed: int = 0) -> list[RoutingMask]:
    """``n`` distinct uniformly random masks skipping ``k`` skippable layers (a search baseline)."""
    layers = skippable_layers(model)
    n = min(n, math.comb(len(layers), k))
    rng = random.Random(seed)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < n:
        skip = tuple(sorted(rng.sample(layers, k)))
        if skip not in chosen:
            chosen.append(skip)
    return [RoutingMask.from_model(model, skip=list(skip), metadata={"baseline": "random"}) for skip in chosen]


def early_exit_mask(model: nn.Module, k: int) -> RoutingMask:
    """Skip the last ``k`` skippable layers before the final one (the early-exit baseline)."""
    skip = skippable_layers(model)[-k:]
    return RoutingMask.from_model(model, skip=skip, metadata={"baseline": "early exit"})
