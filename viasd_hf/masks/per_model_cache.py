"""What a ``generate`` call looks up once per model (routing masks, draft vocabularies), not on every call.

Why this exists: finding a mask or a vocabulary by the model pair may ask the Hub, and ``generate``
runs once per request, so without a cache every call would pay for a lookup and an unreachable
Hub would make every call wait. Values are kept weakly by the model, so that a deleted model takes
them with it. ``generate`` may run in several threads: a lock guards the table, and a second one
lets only one first lookup run at a time, so threads that start together ask the Hub once.
Whatever a lookup returns is kept, ``None`` included (a remembered miss); a lookup that raises
keeps nothing and is tried again by the next call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar
from weakref import WeakKeyDictionary

from torch import nn

T = TypeVar("T")

_MISSING = object()


class PerModelCache(Generic[T]):
    """Values looked up once per ``(model, key)``."""

    def __init__(self) -> None:
        self._values: WeakKeyDictionary[nn.Module, dict[Hashable, T]] = WeakKeyDictionary()
        self._table_lock = threading.Lock()  # guards _values
        self._lookup_lock = threading.Lock()  # one first lookup at a time (cached reads do not take it)

    def get(self, model: nn.Module, key: Hashable, lookup: Callable[[], T]) -> T:
        """The value stored for ``(model, key)``, else ``lookup()``'s, stored (the first call only runs the lookup)."""
        value = self._stored(model, key)
        if value is not _MISSING:
            return value
        with self._lookup_lock:
            value = self._stored(model, key)  # another thread may have looked it up while this one waited
            if value is _MISSING:
                value = lookup()
                with self._table_lock:
                    self._values.setdefault(model, {})[key] = value
        return value

    def clear(self, model: nn.Module | None = None) -> None:
        """Forget what was stored for ``model`` (for every model when ``None``)."""
        with self._table_lock:
            if model is None:
                self._values.clear()
            else:
                self._values.pop(model, None)

    def _stored(self, model: nn.Module, key: Hashable) -> T | object:
        with self._table_lock:
            return self._values.get(model, {}).get(key, _MISSING)
