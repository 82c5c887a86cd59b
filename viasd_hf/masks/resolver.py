"""Which routing mask (or mask set) a ``generate`` call runs with, looked up once per model.

A mask comes as a ``RoutingMask`` or ``MaskSet``, as a local path or Hub id, or, with
``ViaSDConfig(routing_mask=None)`` (the default), by the model pair: the user cache, the masks
repo on the Hub, then the masks shipped in ``hub_masks/`` (``viasd_hf.masks.repo``). Reading a
path or asking the Hub costs time, so what a (model, drafter, spec) resolves to is kept for that
model (``viasd_hf.masks.per_model_cache``); a failed lookup raises and is tried again by the next
call. :func:`clear_mask_cache` forgets them (after publishing a new mask, say).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from viasd_hf.masks.architectures import model_config
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.per_model_cache import PerModelCache
from viasd_hf.masks.repo import default_masks_repo, search_command
from viasd_hf.masks.routing_mask import MaskNotFoundError, RoutingMask
from viasd_hf.masks.rules import SELF_DRAFT_SKIP_RATIO, rule_mask

logger = logging.getLogger("viasd_hf")

T = TypeVar("T")
Source = str | os.PathLike[str] | tuple[str, str]

_resolved: PerModelCache[Any] = PerModelCache()
_for_calls: PerModelCache[Any] = PerModelCache()  # what masks_for_call found, misses included, and what it said


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


@dataclass(frozen=True)
class CallMasks:
    """The masks a ``generate`` call runs with: the slim tier's (``None``: no slim tier) and the self-drafter's."""

    slim: RoutingMask | MaskSet | None
    self_draft: RoutingMask | None


def masks_for_call(
    model: nn.Module,
    drafter_id: str,
    slim: RoutingMask | MaskSet | Source | None,
    self_draft: RoutingMask | Source | None,
    *,
    use_slim: bool,
    slim_required: bool,
    self_drafts: bool,
) -> CallMasks:
    """The slim tier's mask (when ``use_slim``) and the self-drafter's (when ``self_drafts``), given or the pair's.

    A pair without a slim mask runs without the slim tier, unless ``slim_required`` (tiered mode): then
    ``MaskNotFoundError`` names where it looked and the command that finds one. A self-drafter without a
    mask drafts with ``rules.rule_mask``. Either says so once per model, in one line.
    """
    missing: list[str] = []
    slim_masks = None
    if use_slim:
        slim_masks = _pair_or_none(slim, model, drafter_id, resolve_slim_masks)
        if isinstance(slim_masks, MaskNotFoundError):
            if slim_required:
                raise MaskNotFoundError(
                    f"tiered mode commits the slim verifier's tokens, so it needs a routing mask for this model pair: "
                    f"{slim_masks}\nFind one with `{_search(model, drafter_id)}` (the next generate finds it), or "
                    "pass ViaSDConfig(routing_mask=RoutingMask.from_model(model, skip=[...]))"
                )
            missing.append(f"no routing mask, so no slim tier (`{_search(model, drafter_id)}` finds one)")
            slim_masks = None
    drafting_mask = None
    if self_drafts:
        drafting_mask = _pair_or_none(self_draft, model, "self-drafter", resolve_mask)
        if isinstance(drafting_mask, MaskNotFoundError):
            drafting_mask = rule_mask(model, SELF_DRAFT_SKIP_RATIO)
            missing.append(f"no self-drafting mask, so the self-drafter skips layers {drafting_mask.skipped_layers} "
                           f"by rule (`{_search(model, 'self-drafter')}` finds a better one)")
    _say_once(model, missing)
    return CallMasks(slim_masks, drafting_mask)


def model_name(model: nn.Module) -> str:
    """The model's Hub id or folder, as its config names it (empty for a model built from a config)."""
    return str(getattr(model_config(model), "_name_or_path", "") or "")


def _search(model: nn.Module, drafter_id: str) -> str:
    name = model_name(model) or "<the model's folder or Hub id: save it with save_pretrained first>"
    return search_command(name, drafter_id)


def _pair_or_none(spec: Any, model: nn.Module, drafter_id: str, resolve: Callable[..., T]) -> T | MaskNotFoundError:
    """``resolve(spec, model, drafter_id)``; the pair's miss (``spec`` is ``None``) is returned, and remembered, so that
    a pair without a mask costs one lookup per model, not one per call."""
    if spec is not None:
        return resolve(spec, model, drafter_id)

    def lookup() -> T | MaskNotFoundError:
        try:
            return resolve(None, model, drafter_id)
        except MaskNotFoundError as miss:
            return miss

    return _for_calls.get(model, ("pair", resolve.__name__, model_name(model), drafter_id, default_masks_repo()), lookup)


def _say_once(model: nn.Module, missing: list[str]) -> None:
    """Log, as one warning line, those of the ``missing`` masks not yet said for ``model`` (stderr by default)."""
    fresh = object()
    new = [what for what in missing if _for_calls.get(model, ("said", what), lambda: fresh) is fresh]
    if new:
        logger.warning(f"viasd_hf: {model_name(model)}: {'; '.join(new)}")


def clear_mask_cache(model: nn.Module | None = None) -> None:
    """Forget the masks resolved for ``model`` (every model when ``None``); the next ``generate`` looks them up again."""
    _resolved.clear(model)
    _for_calls.clear(model)


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
