"""The slim verifier: the target model itself, run with some decoder layers skipped for real.

Skipping is done by replacing the skipped layers' instance ``forward`` with a pass-through, so
their weights are never read (the point of the slim tier) and they write nothing to the KV
cache. A forward hook would still run the layer. Swapping the ``ModuleList`` would break models
that index ``config.layer_types`` by position (Qwen2, Gemma3). accelerate's offload hooks also
live in the instance ``forward``; ours sits on top and is removed last-in-first-out, so the
model is restored exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from .architectures import decoder_layers, skipping_forward
from .masks import RoutingMask

_MISSING = object()


@contextmanager
def routed(model: nn.Module, mask: RoutingMask) -> Iterator[nn.Module]:
    """Within this block, forward passes of ``model`` skip the layers ``mask`` does not keep."""
    mask.validate_for(model)
    layers = decoder_layers(model)
    replaced: list[tuple[nn.Module, object]] = []
    try:
        for index in mask.skipped_layers:
            layer = layers[index]
            replaced.append((layer, layer.__dict__.get("forward", _MISSING)))
            layer.forward = skipping_forward(layer, model)
        yield model
    finally:
        for layer, previous in reversed(replaced):
            if previous is _MISSING:
                del layer.forward
            else:
                layer.forward = previous
