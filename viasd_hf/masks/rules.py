"""A routing mask by rule, from the model's structure alone, for a model with no searched mask.

The self-drafter (the target drafting for itself with some layers skipped) needs a mask even where no search has
been run (``masks.resolver.masks_for_call`` falls back to this one). The rule, ``rule_layers``:

    Skip k = round(s·L) of the L decoder layers, every other layer outward from the middle of the stack
    (L//2, L//2 − 2, L//2 + 2, …), then the layers between those, again from the middle outward. Protected
    layers (``architectures.protected_layers``) are never skipped. Spared while any other layer is left: the
    layers next to the ends of the stack (1 and L − 2) and, in a model that mixes attention kinds, the layers
    of the rarer kinds (``config.layer_types``; Gemma 3's full-attention layers, one in six).

Why (held-out KL and top-1 against random masks of the same budget, SmolLM2-135M and Gemma-3-270M): skipping
the deepest layers (early exit) is far worse than random on SmolLM2, skipping from the middle out better; masks
skipping layer 1, or Gemma 3's full-attention layer 11, were among the worst on those prompts. At 0.15 the rule
beats the median random mask on both models in every task family; at 0.25 it does not on Gemma 3's top-1.
Where a searched mask exists it is better: ``viasd search`` finds one. The measurement, and the choice of
:data:`SELF_DRAFT_SKIP_RATIO`: ``docs/masks.md``, "A mask by rule, for models with none searched"
(``bench/studies/mask_rule``).
"""

from __future__ import annotations

import math
from collections.abc import Collection

from torch import nn

from viasd_hf.masks.architectures import model_config, num_decoder_layers, protected_layers
from viasd_hf.masks.routing_mask import RoutingMask

SELF_DRAFT_SKIP_RATIO = 0.15
"""The self-drafter's budget when it drafts with :func:`rule_mask`: the share of layers skipped (docs/masks.md)."""

RULE = "middle-out, every other layer; layers 1 and L-2 and rarer attention kinds spared"


def rule_layers(num_layers: int, protected: Collection[int], k: int, spared: Collection[int] = ()) -> list[int]:
    """The ``k`` layers the rule skips (fewer when fewer than ``k`` are not ``protected``), in order.

    ``spared`` (besides layers 1 and L − 2) are skipped only when no other layer is left.
    """
    protected, spared = set(protected), {1, num_layers - 2} | set(spared)
    first = middle_out_order(num_layers, protected | spared)
    rest = [layer for layer in middle_out_order(num_layers, protected) if layer not in set(first)]
    return sorted((first + rest)[: max(k, 0)])


def rare_kind_layers(model: nn.Module) -> set[int]:
    """Layers whose attention kind (``config.layer_types``) is rarer in the stack than the most common kind."""
    kinds = list(getattr(model_config(model).get_text_config(decoder=True), "layer_types", None) or ())
    kinds = kinds[: num_decoder_layers(model)]
    counts = {kind: kinds.count(kind) for kind in kinds}
    return {layer for layer, kind in enumerate(kinds) if counts[kind] < max(counts.values())}


def rule_mask(model: nn.Module, skip_ratio: float) -> RoutingMask:
    """The rule's mask for ``model``: k = round(``skip_ratio`` · L) layers skipped (halves round up, as in
    ``viasd search``), or every unprotected layer where fewer are left; deterministic, from the structure only."""
    if not 0.0 <= skip_ratio < 1.0:
        raise ValueError(f"skip ratio must lie in [0, 1), got {skip_ratio}")
    num_layers = num_decoder_layers(model)
    k = math.floor(skip_ratio * num_layers + 0.5)
    skip = rule_layers(num_layers, protected_layers(model), k, rare_kind_layers(model))
    return RoutingMask.from_model(model, skip=skip, skip_ratio=skip_ratio,
                                  metadata={"rule": RULE, "source": "viasd_hf.masks.rules.rule_mask"})  # fmt: skip


def middle_out_order(num_layers: int, excluded: set[int]) -> list[int]:
    """Every other layer from the middle outward (L//2, L//2 − 2, L//2 + 2, …), then the ones between, likewise."""
    middle = num_layers // 2
    by_distance = sorted(range(num_layers), key=lambda layer: (abs(layer - middle), layer))
    order = [layer for layer in by_distance if (layer - middle) % 2 == 0] + \
            [layer for layer in by_distance if (layer - middle) % 2 == 1]  # fmt: skip
    return [layer for layer in order if layer not in excluded]
