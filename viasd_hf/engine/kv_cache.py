"""KV-cache bookkeeping shared by the slim pass and the full model (docs/design.md, "The KV cache").

The slim pass reads the full model's committed prefix and appends provisional K/V at the
layers it keeps; those entries are not the full model's and must go again. So every routed
pass is followed by ``crop_to(cache, committed)``, which restores the invariant that every
self-attention layer holds exactly the tokens the full model has processed. Cross-attention
K/V (encoder-decoder models) depend only on the encoder output, so every tier shares them as
they are.
"""

from __future__ import annotations

from transformers import Cache, DynamicCache, EncoderDecoderCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


def new_cache(config: PretrainedConfig, prepared: Cache | None = None) -> Cache:
    """An empty cache (``generate``'s own when it prepared one) whose sliding layers can be cropped."""
    check_empty(prepared)
    if prepared is not None:
        cache = prepared
    elif getattr(config, "is_encoder_decoder", False):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    else:
        cache = DynamicCache(config=config)
    for layer in self_attention_layers(cache):
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def check_empty(prepared: Cache | None) -> None:
    """VIA-SD starts from the prompt: ``generate``'s cache (if it prepared one) must hold nothing yet."""
    if prepared is not None and prepared.get_seq_length() > 0:
        raise ValueError("VIA-SD starts from the prompt; continuing from a pre-filled cache is not supported")


def self_attention_layers(cache: Cache) -> list:
    return (cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache).layers


def full_attention_only(cache: Cache) -> bool:
    """Whether every self-attention layer is a plain ``DynamicLayer``: it holds every token fed, at the column it was
    fed in (no sliding window, no fixed size), so any mask over those columns is honoured."""
    return all(type(layer) is DynamicLayer for layer in self_attention_layers(cache))


def layer_lengths(cache: Cache) -> list[int]:
    return [layer.get_seq_length() for layer in self_attention_layers(cache)]


def crop_to(cache: Cache, length: int) -> None:
    """Drop every self-attention layer's entries beyond ``length`` tokens (layers differ after a routed pass)."""
    for layer in self_attention_layers(cache):
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
        elif getattr(layer, "is_sliding", False) and layer.is_initialized:
            # trims a past-recording sliding layer back to its window; a layer that no pass has
            # written yet (skipped by the first routed pass of a one-token prompt) holds nothing to trim
            layer.crop(0)
