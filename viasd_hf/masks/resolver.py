"""Which routing mask (or mask set) a ``generate`` call runs with, looked up once per model.

A mask comes as a ``RoutingMask`` or ``MaskSet``, as a local path or Hub id, or, with
``ViaSDConfig(routing_mask=None)`` (the default), by the model pair: the user cache, the masks
repo on the Hub, then the masks shipped in ``hub_masks/`` (``viasd_hf.masks.repo``). Reading a
path or asking the Hub costs time, so what a (model, drafter, spec) resolves to is kept for that
model (``viasd_hf.models.per_model_cache``); a failed lookup raises and is tried again by the next
call. :func:`clear_mask_cache` forgets them (after publishing a new mask, say).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from viasd_hf.masks.architectures import model_config
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.repo import default_masks_repo
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.per_model_cache import PerModelCache

T = TypeVar("T")
Source = str | os.PathLike[str] | tuple[str, str]

_resolved: PerModelCache[Any] = PerModelCache()


def resolve_mask(spec: RoutingMask | Source | None, model: nn.Module, drafter_id: str) -> RoutingMask:
    """One validated mask: ``spec`` itself, read from a path or Hub id, or (``None``) the mask known for this pair."""
    mask = spec if isinstance(spec, RoutingMask) else _looked_up(spec, model, drafter_id, RoutingMask.from_pretrained)
    mask.validate_for(model)
    return mask


def resolve_slim_masks(
    spec: RoutingMask | MaskSet | Source | None, model: nn.Module, drafter_id: str
) -> RoutingMask | MaskSet:
    """The slim tier's mask, or its mask set when there is more than one mask to choose from, validated for ``model``.

    ``None`` reads the pair's set (or single mask); a path or Hub id likewise. A set of one is its mask.
    """
    if isinstance(spec, RoutingMask):
        found: RoutingMask | MaskSet = spec
    elif isinstance(spec, MaskSet):
        found = _unwrapped(spec)
    else:
        found = _looked_up(spec, model, drafter_id, lambda source: _unwrapped(MaskSet.from_pretrained(source)))
    found.validate_for(model)
    return found


def clear_mask_cache(model: nn.Module | None = None) -> None:
    """Forget the masks resolved for ``model`` (every model when ``None``); the next ``generate`` looks them up again."""
    _resolved.clear(model)


def _looked_up(spec: Source | None, model: nn.Module, drafter_id: str, load: Callable[[Source], T]) -> T:
    """``load`` of ``spec`` (``None``: of the pair), once per model and key. Both resolvers use the same keys,
    so a pair without a set is cached as the mask it was."""
    if spec is None:
        pair = (str(model_config(model)._name_or_path), drafter_id)
        return _resolved.get(model, ("pair", *pair, default_masks_repo()), lambda: load(pair))
    if isinstance(spec, (str, os.PathLike)):
        return _resolved.get(model, ("spec", os.fspath(spec)), lambda: load(spec))
    return load(spec)


def _unwrapped(masks: MaskSet) -> RoutingMask | MaskSet:
    return masks.default_mask if len(masks.masks) == 1 else masks
