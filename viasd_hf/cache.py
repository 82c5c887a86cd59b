"""KV-cache bookkeeping shared by the slim pass and the full model (DESIGN §4).

The slim pass reads the full model's committed prefix and appends provisional K/V at the
layers it keeps; those entries are not the full model's and must go again. So every routed
pass is followed by ``crop_to(cache, committed)``, which restores the invariant that every
layer holds exactly the tokens the full model has processed.
"""

from __future__ import annotations

from transformers import Cache, DynamicCache, PretrainedConfig


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """A dynamic cache whose sliding-window layers keep their past, so they can be cropped."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def layer_lengths(cache: Cache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def crop_to(cache: Cache, length: int) -> None:
    """Drop every layer's entries beyond ``length`` tokens (layers may differ after a routed pass)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
        elif getattr(layer, "is_sliding", False):
            layer.crop(0)  # trims a past-recording sliding layer back to its window
