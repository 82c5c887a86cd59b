"""Routing masks resolved once per model, not on every ``generate`` call.

Why this exists: ``ViaSDConfig(routing_mask=None)`` (the default) names the mask by the model
pair, and finding it may ask the Hub (``viasd_hf.hub``); a path or Hub id has to be read too.
``generate`` runs once per request, so without this every call would pay for a lookup, and an
unreachable Hub would make every call wait. The mask a (model, drafter, mask spec) resolves to is
kept here, keyed weakly by the model so that a deleted model takes its masks with it. ``generate``
may run in several threads: a lock guards the table, and a second one lets only one first lookup
run at a time, so threads that start together ask the Hub once. Only found masks are kept; a
failed lookup raises and is tried again by the next call. :func:`clear_mask_cache` forgets them
(after publishing a new mask, say).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from torch import nn

T = TypeVar("T")  # a routing mask, or a mask set (``viasd_hf.mask_set``)

_masks: WeakKeyDictionary[nn.Module, dict[Hashable, Any]] = WeakKeyDictionary()
_table_lock = threading.Lock()  # guards _masks
_lookup_lock = threading.Lock()  # one first lookup at a time (it may wait on the Hub; cached reads do not take it)


def _cached(model: nn.Module, key: Hashable) -> Any:
    with _table_lock:
        return _masks.get(model, {}).get(key)


def cached_mask(model: nn.Module, key: Hashable, lookup: Callable[[], T]) -> T:
    """The mask stored for ``(model, key)``, else ``lookup()``'s, stored (the first call only runs the lookup)."""
    mask = _cached(model, key)
    if mask is not None:
        return mask
    with _lookup_lock:
        mask = _cached(model, key)  # another thread may have looked it up while this one waited
        if mask is None:
            mask = lookup()
            with _table_lock:
                _masks.setdefault(model, {})[key] = mask
    return mask


def clear_mask_cache(model: nn.Module | None = None) -> None:
    """Forget the masks resolved for ``model`` (every model when ``None``); the next ``generate`` looks them up again."""
    with _table_lock:
        if model is None:
            _masks.clear()
        else:
            _masks.pop(model, None)
