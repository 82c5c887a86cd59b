"""Routing masks resolved once per model, not on every ``generate`` call (``viasd_hf.models.per_model_cache``).

``ViaSDConfig(routing_mask=None)`` (the default) names the mask by the model pair, and finding it
may ask the Hub (``viasd_hf.hub.publish``); a path or Hub id has to be read too. The mask a (model,
drafter, mask spec) resolves to is kept; a failed lookup raises and is tried again by the next
call. :func:`clear_mask_cache` forgets them (after publishing a new mask, say).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from torch import nn

from viasd_hf.models.per_model_cache import PerModelCache

T = TypeVar("T")  # a routing mask, or a mask set (``viasd_hf.masks.mask_set``)

_masks: PerModelCache[Any] = PerModelCache()


def cached_mask(model: nn.Module, key: Hashable, lookup: Callable[[], T]) -> T:
    """The mask stored for ``(model, key)``, else ``lookup()``'s, stored (the first call only runs the lookup)."""
    return _masks.get(model, key, lookup)


def clear_mask_cache(model: nn.Module | None = None) -> None:
    """Forget the masks resolved for ``model`` (every model when ``None``); the next ``generate`` looks them up again."""
    _masks.clear(model)
