"""The slim verifier: the target model itself, run with some decoder layers skipped for real.

Skipping is done in the skipped layers' instance ``forward``, so their weights are never read
(the point of the slim tier) and they write nothing to the KV cache. A forward hook would still
run the layer. Swapping the ``ModuleList`` would break models that index ``config.layer_types``
by position (Qwen2, Gemma3).

A skip applies only to the call that asked for it, so one model can serve several threads (or
asyncio tasks) at once, VIA-SD and plain ``generate`` alike. A layer some call may skip gets a
switch as its instance ``forward``; the switch skips the layer in a context whose
``ContextVar`` names it and otherwise runs the forward it replaced. Switches are reference
counted under one lock: the first routed call on a layer installs its switch, the last one to
leave removes it, so outside any routed call the model is exactly as it was (``deepcopy``,
pickling and ``save_pretrained`` see a pristine model). accelerate's offload hooks also live in
the instance ``forward``; the switch sits on top and is removed last-in-first-out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

from viasd_hf.masks.architectures import decoder_layers, is_encoder_decoder, returned_form, skipping_forward
from viasd_hf.masks.routing_mask import RoutingMask

_MISSING = object()

# ids of the layers the current context skips (a layer is alive while a routed block holds it)
_SKIPPED: ContextVar[frozenset[int]] = ContextVar("viasd_skipped_layers", default=frozenset())

# one lock for all models: installing or removing a few switches takes microseconds
_LOCK = threading.Lock()


class _SkipSwitch:
    """A layer's instance ``forward`` while some call may skip it: skip where asked, else the replaced forward."""

    def __init__(self, layer: nn.Module, skip: Callable[..., Any]) -> None:
        self.layer = layer
        self.skip = skip
        self.replaced = layer.__dict__.get("forward", _MISSING)
        self.run = layer.forward
        self.users = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if id(self.layer) in _SKIPPED.get():
            return self.skip(*args, **kwargs)
        return self.run(*args, **kwargs)

    def restore(self) -> None:
        if self.replaced is _MISSING:
            del self.layer.forward
        else:
            self.layer.forward = self.replaced


def _switch_of(layer: nn.Module) -> _SkipSwitch | None:
    """The layer's switch, kept as its instance ``forward`` (so a PEFT wrapper and its base model share it)."""
    forward = layer.__dict__.get("forward")
    return forward if isinstance(forward, _SkipSwitch) else None


def _acquire(layer: nn.Module, model: nn.Module) -> None:
    switch = _switch_of(layer)
    if switch is None:
        switch = _SkipSwitch(layer, skipping_forward(layer, model))
        layer.forward = switch
    switch.users += 1


def _release(layer: nn.Module) -> None:
    switch = _switch_of(layer)
    switch.users -= 1
    if switch.users == 0:
        switch.restore()


@contextmanager
def skipping(model: nn.Module, skipped: Sequence[int]) -> Iterator[nn.Module]:
    """Within this block, forward passes of ``model`` *in this context* skip the decoder layers ``skipped``.

    ``skipped`` must come from a mask already validated for ``model`` (``RoutingMask.validate_for``):
    validation reads the whole config, too slow for every pass. Nested blocks skip the union.
    """
    all_layers = decoder_layers(model)
    layers = [all_layers[index] for index in skipped]
    if layers and not is_encoder_decoder(model):
        returned_form(model)  # learnt once, by a pass of the first layer, before the lock is taken
    held: list[nn.Module] = []
    try:
        with _LOCK:
            for layer in layers:
                _acquire(layer, model)
                held.append(layer)
        token = _SKIPPED.set(_SKIPPED.get() | {id(layer) for layer in layers})
        try:
            yield model
        finally:
            _SKIPPED.reset(token)
    finally:
        with _LOCK:
            for layer in reversed(held):
                _release(layer)


def skipped_layers_here(model: nn.Module) -> list[int]:
    """The decoder layers of ``model`` that forward passes in this context skip (inside ``routed`` or ``skipping``)."""
    skipped = _SKIPPED.get()
    return [index for index, layer in enumerate(decoder_layers(model)) if id(layer) in skipped]


@contextmanager
def routed(model: nn.Module, mask: RoutingMask) -> Iterator[nn.Module]:
    """Within this block, forward passes of ``model`` skip the layers ``mask`` does not keep.

    Only calls made in this thread (or this asyncio task) are routed; other threads using the
    same model run it in full.
    """
    if not isinstance(mask, RoutingMask):
        hint = ": pass one of its masks (masks.default_mask, or masks.masks[name])" if hasattr(mask, "masks") else ""
        raise TypeError(f"routed() takes a RoutingMask, got {type(mask).__name__}{hint}")
    mask.validate_for(model)
    with skipping(model, mask.skipped_layers) as routed_model:
        yield routed_model
