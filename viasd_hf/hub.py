"""Routing masks on the Hugging Face Hub: publishing a mask folder with its search log (for ``viasd push``).

The layers below do the work and never import this module: :mod:`viasd_hf.mask_repo` (where a
pair's mask lives in a masks repo and the order it is looked up in), :mod:`viasd_hf.hub_files`
(one brief Hub lookup, the user cache, one-commit uploads) and ``RoutingMask.push_to_hub`` /
``RoutingMask.from_pretrained`` (:mod:`viasd_hf.masks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo

from .mask_repo import SEARCH_LOG_FILENAME
from .masks import RoutingMask


def push_mask(source: RoutingMask | str | Path, repo_id: str, **options: Any) -> CommitInfo:
    """Publish a mask (a ``RoutingMask``, or a folder/JSON file with ``search_log.jsonl`` beside it) in one commit.

    ``options`` are those of ``RoutingMask.push_to_hub`` (``endpoint``, ``revision``, ``token``,
    ``model``, ``target_slug``, ``drafter_slug``, ...).
    """
    mask, search_log = _mask_and_search_log(source)
    return mask.push_to_hub(repo_id, search_log=search_log, **options)


def _mask_and_search_log(source: RoutingMask | str | Path) -> tuple[RoutingMask, bytes | None]:
    """The mask to push and, when pushing from a folder or file, the search log lying beside it."""
    if isinstance(source, RoutingMask):
        return source, None
    path = Path(source)
    mask = RoutingMask.from_pretrained(path)
    log = (path if path.is_dir() else path.parent) / SEARCH_LOG_FILENAME
    return mask, log.read_bytes() if log.is_file() else None
