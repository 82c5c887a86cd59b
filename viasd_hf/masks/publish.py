"""Routing masks on the Hugging Face Hub: publishing a mask or mask set folder with its search log (for ``viasd push``).

The layers below do the work and never import this module: :mod:`viasd_hf.masks.repo` (where a
pair's mask lives in a masks repo and the order it is looked up in), :mod:`viasd_hf.hub.files`
(one brief Hub lookup, the user cache, one-commit uploads), ``RoutingMask.push_to_hub`` /
``RoutingMask.from_pretrained`` (:mod:`viasd_hf.masks.routing_mask`) and their ``MaskSet`` twins (:mod:`viasd_hf.masks.mask_set`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo

from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.repo import MASK_SET_FILENAME, SEARCH_LOG_FILENAME
from viasd_hf.masks.routing_mask import RoutingMask, check_pushable


def push_mask(source: RoutingMask | MaskSet | str | Path, repo_id: str, **options: Any) -> CommitInfo:
    """Publish a mask or a mask set (or a folder/JSON file holding one, with ``search_log.jsonl`` beside it) in one commit.

    ``options`` are those of ``RoutingMask.push_to_hub`` / ``MaskSet.push_to_hub`` (``endpoint``,
    ``revision``, ``token``, ``model``, ``target_slug``, ``drafter_slug``, ...).
    """
    if isinstance(source, (RoutingMask, MaskSet)):
        return source.push_to_hub(repo_id, **options)
    path = Path(source)
    log = (path if path.is_dir() else path.parent) / SEARCH_LOG_FILENAME
    return read_pushable(path).push_to_hub(repo_id, search_log=log.read_bytes() if log.is_file() else None, **options)


def read_pushable(path: Path) -> RoutingMask | MaskSet:
    """The mask set in a set's folder (or its ``mask_set.json``), else the routing mask there, checked as a push checks it.

    Read as a single mask, a set's folder would publish its default member alone.
    """
    if (path / MASK_SET_FILENAME).is_file() or path.name == MASK_SET_FILENAME:
        masks = MaskSet.from_pretrained(path)
        masks.check_pushable()
        return masks
    mask = RoutingMask.from_pretrained(path)
    check_pushable(mask)
    return mask
