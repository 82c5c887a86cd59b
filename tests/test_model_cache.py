"""PerModelCache: one lookup per (model, key), misses remembered, failures not, values gone with the model."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from torch import nn

from viasd_hf.masks.per_model_cache import PerModelCache


def test_a_value_and_a_miss_are_looked_up_once_per_model_and_key():
    cache: PerModelCache[str | None] = PerModelCache()
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    calls: list[str] = []

    def lookup(value: str | None):
        return lambda: calls.append(str(value)) or value

    assert cache.get(model, "a", lookup("A")) == "A"
    assert cache.get(model, "a", lookup("changed")) == "A"
    assert cache.get(model, "miss", lookup(None)) is None
    assert cache.get(model, "miss", lookup("found later")) is None  # a miss is remembered too
    assert cache.get(other, "a", lookup("B")) == "B"
    cache.clear(model)
    assert cache.get(model, "a", lookup("C")) == "C"
    assert cache.get(other, "a", lookup("changed")) == "B"
    assert calls == ["A", "None", "B", "C"]


def test_a_failed_lookup_keeps_nothing_and_is_tried_again():
    cache: PerModelCache[int] = PerModelCache()
    model = nn.Linear(2, 2)

    def fail() -> int:
        raise LookupError("the Hub did not answer")

    with pytest.raises(LookupError):
        cache.get(model, "k", fail)
    assert cache.get(model, "k", lambda: 7) == 7


def test_threads_that_start_together_run_the_lookup_once():
    cache: PerModelCache[int] = PerModelCache()
    model = nn.Linear(2, 2)
    calls = []

    def slow_lookup() -> int:
        calls.append(1)
        time.sleep(0.05)
        return 3

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(model, "k", slow_lookup))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [3] * 8 and len(calls) == 1


def test_values_go_with_their_model():
    cache: PerModelCache[int] = PerModelCache()
    model = nn.Linear(2, 2)
    cache.get(model, "k", lambda: 1)
    del model
    gc.collect()
    assert len(cache._values) == 0
