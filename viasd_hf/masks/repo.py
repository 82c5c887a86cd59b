"""Where a model pair's routing mask lives in a masks repo, and where a pair's mask is looked up.

One Hub repo holds the masks of many model pairs; the ``hub_masks/`` folder shipped with viasd_hf
mirrors its layout::

    <target-slug>/<drafter folder>/routing_mask.json
    <target-slug>/<drafter folder>/search_log.jsonl    (when the search left one)
    <target-slug>/<drafter folder>/mask_set.json       (a set of masks for the pair, when there is one:
    <target-slug>/<drafter folder>/masks/<name>.json    its index, and its members but the default,
                                                        which is routing_mask.json; viasd_hf.masks.mask_set)
    README.md                                          (model card listing every pair, generated)

A slug is the model id lowercased with ``/`` replaced by ``--``, so a zoo name such as
``qwen2.5-coder-1.5b-instruct`` stays as it is and ``Qwen/Qwen2.5-Coder-1.5B-Instruct`` becomes
``qwen--qwen2.5-coder-1.5b-instruct``. The drafter folder is the drafter model's slug, or one of
two names for masks that go with no drafter model:

- ``model-free`` (:data:`MODEL_FREE`): the slim verifier's mask when the drafts come from no
  drafter model (prompt lookup, the self-drafter). Masks searched without a drafter record the
  drafter id ``"self"``, which names this folder too (``viasd pull --drafter self``).
- ``self-draft`` (:data:`SELF_DRAFT`): the self-drafter's own, heavier drafting mask
  (``ViaSDConfig.self_draft_mask``), asked for by ``generate`` and ``viasd bench`` as the drafter
  id ``"self-drafter"``.

These folders used to be called ``self`` and ``self-drafter``, names that read the wrong way
round; masks already published under them are still found (:data:`LEGACY_FOLDERS`).

Where a pair's mask is looked up:

- with an explicit ``repo_id`` or ``revision``: that repo and revision only. A miss is an error;
  the shipped masks never stand in for an explicit request.
- by default: the user's masks folder (:func:`user_masks_dir`, where ``viasd search`` saves), then
  the masks repo (``$VIASD_MASKS_REPO``, else the project's repo; ``main``), then the shipped
  folder. The user's folder and the shipped one are only ever read from disk.

A model loaded from a local folder is named by that folder's absolute path (:func:`pair_id`), so a
mask searched for ``./my-model`` is found wherever the program that loads it runs.

In each place, a pair's mask set is looked for before its single mask when both are asked for.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import NamedTuple

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import EntryNotFoundError

from viasd_hf.hub.files import HUB_MISSES, Lookup, NotFoundError, describe_miss, fetch, not_found_message

MASK_FILENAME = "routing_mask.json"
MASK_SET_FILENAME = "mask_set.json"
MEMBERS_FOLDER = "masks"  # a mask set's members, but its default (routing_mask.json)
SEARCH_LOG_FILENAME = "search_log.jsonl"
DEFAULT_MASKS_REPO = "viasd-hf/routing-masks"
MASKS_REPO_ENV = "VIASD_MASKS_REPO"
USER_MASKS_ENV = "VIASD_MASKS_DIR"

MODEL_FREE = "model-free"
SELF_DRAFT = "self-draft"
# Drafter ids that name no drafter model, and their folders (see the module docstring).
_FOLDER_OF_DRAFTER_ID = {"self": MODEL_FREE, "self-drafter": SELF_DRAFT}
# The drafter folders' former names: a mask missing under the new name is looked for under the old one on the Hub.
LEGACY_FOLDERS = {MODEL_FREE: "self", SELF_DRAFT: "self-drafter"}

HOW_TO_GET_A_MASK = (
    "To get a mask: search one for the model with `viasd search` (and publish it with `viasd push`), "
    "or download a published one with `viasd pull --target TARGET --drafter DRAFTER --repo-id REPO --out DIR`."
)


def pair_id(model_id: str) -> str:
    """How a model is named in a pair: its Hub id or zoo name as given, or, for a local folder, its absolute path."""
    return os.path.abspath(model_id) if model_id and os.path.isdir(model_id) else model_id


def search_command(target: str, drafter: str = "self") -> str:
    """The ``viasd search`` command that finds the ``(target, drafter)`` pair's mask and saves it where the next
    ``generate`` for that pair looks first."""
    words = ["viasd", "search", "--target", pair_id(target)]
    if drafter != "self":
        words += ["--drafter", pair_id(drafter)]
    return shlex.join(words)


def user_masks_dir() -> Path:
    """The user's own masks, in the layout of a masks repo: ``$VIASD_MASKS_DIR``, else ``viasd_hf/masks`` in the
    Hugging Face home folder (``$HF_HOME``, by default ``~/.cache/huggingface``)."""
    return Path(os.environ.get(USER_MASKS_ENV) or Path(constants.HF_HOME) / "viasd_hf" / "masks")


def model_slug(model_id: str) -> str:
    """The folder name of a model in a masks repo: the id lowercased, ``/`` replaced by ``--``."""
    return model_id.strip().strip("/").lower().replace("/", "--")


def drafter_folder(drafter: str) -> str:
    """The folder of masks made for ``drafter``: a drafter model's slug, or a folder of the module docstring."""
    slug = model_slug(drafter or "self")
    return _FOLDER_OF_DRAFTER_ID.get(slug, slug)


def pair_folder(target: str, drafter: str = "self") -> str:
    """The folder of the ``(target, drafter)`` pair in a masks repo (ids or slugs alike)."""
    return f"{model_slug(target)}/{drafter_folder(drafter)}"


def mask_path_in_repo(target: str, drafter: str = "self") -> str:
    """Where the mask of the ``(target, drafter)`` pair lives in a masks repo."""
    return f"{pair_folder(target, drafter)}/{MASK_FILENAME}"


def mask_set_files(paths: list[str], folder: str) -> list[str]:
    """Those of ``paths`` (in a repo) that belong to a mask set in ``folder``: its index and its members but the default."""
    return [path for path in paths if path == f"{folder}/{MASK_SET_FILENAME}" or path.startswith(f"{folder}/{MEMBERS_FOLDER}/")]


def default_masks_repo() -> str:
    """The masks repo to look pairs up in: ``$VIASD_MASKS_REPO``, else the project's public one."""
    return os.environ.get(MASKS_REPO_ENV) or DEFAULT_MASKS_REPO


def shipped_mask_dir() -> Path:
    """The ``hub_masks`` folder shipped with viasd_hf: inside the package when installed from a wheel,
    at the repository root in a source checkout (editable installs included)."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "hub_masks"
    return installed if installed.is_dir() else package.parent / "hub_masks"


class PairFile(NamedTuple):
    """A pair's file as found: its local copy, where it was found, and its repo and path there (``None`` when shipped)."""

    path: Path
    where: str
    repo_id: str | None
    path_in_repo: str | None


def find_pair_file(
    api: HfApi,
    target: str,
    drafter: str,
    repo_id: str | None,
    lookup: Lookup,
    filenames: tuple[str, ...] = (MASK_FILENAME,),
    *,
    fallback_drafters: tuple[str, ...] = (),
    what: str = "routing mask",
    how_to: str = HOW_TO_GET_A_MASK,
) -> PairFile:
    """The first of ``filenames`` found for the ``(target, drafter)`` pair, in the order of the module docstring.

    ``fallback_drafters`` are folders of the same target looked in after the pair's own, in each
    place (a draft vocabulary is the target's, so any drafter may use the ``model-free`` one).
    Raises ``NotFoundError`` naming every place it looked, ``what`` it looked for and ``how_to`` get one.
    """
    target, drafter = pair_id(target), pair_id(drafter)
    headline = f"no {what} for target {target!r} with drafter {drafter!r}"
    if not model_slug(target):  # a model built from a config has no name to look its pair up by
        raise NotFoundError(
            f"{headline}: the target has no name (its config's _name_or_path is empty), so there is no pair "
            f"to look up.\n{how_to}"
        )
    folders = tuple(dict.fromkeys(drafter_folder(name) for name in (drafter, *fallback_drafters)))
    explicit = repo_id is not None or lookup["revision"] is not None
    repo_id = repo_id or default_masks_repo()
    looked: list[str] = []
    if not explicit:
        found = _on_disk(user_masks_dir(), "the user's masks", target, folders, filenames, looked)
        if found is not None:
            return found
    for filename, note in _paths_on_hub(target, folders, filenames):
        try:
            return PairFile(*fetch(api, repo_id, filename, lookup), repo_id, filename)
        except HUB_MISSES as error:
            looked.append(note + describe_miss(api, repo_id, filename, lookup["revision"], error))
            if not isinstance(error, EntryNotFoundError):  # no repo, revision or answer: another path misses alike
                break
    if explicit:  # that repo and revision, or an error: never a file the caller did not ask for
        raise NotFoundError(
            not_found_message(headline, looked, how_to) + "\nThe files shipped with viasd_hf are only "
            "used when neither repo_id nor revision is given."
        )
    found = _on_disk(shipped_mask_dir(), "the files shipped with viasd_hf", target, folders, filenames, looked)
    if found is not None:
        return found
    raise NotFoundError(not_found_message(headline, looked, how_to))


def _on_disk(
    root: Path, where: str, target: str, folders: tuple[str, ...], filenames: tuple[str, ...], looked: list[str]
) -> PairFile | None:
    """The first of the pair's files under ``root`` (a folder in a masks repo's layout), noting each miss in ``looked``."""
    for folder in folders:
        for filename in filenames:
            path = root / model_slug(target) / folder / filename
            if path.is_file():
                return PairFile(path, f"{where} ({path})", None, None)
            looked.append(f"{where}: no {path}")
    return None


def _paths_on_hub(target: str, folders: tuple[str, ...], filenames: tuple[str, ...]) -> list[tuple[str, str]]:
    """The files in each drafter folder of a masks repo, then under the folder's legacy name (if it had one)."""
    paths: list[tuple[str, str]] = []
    for folder in folders:
        paths += [(f"{model_slug(target)}/{folder}/{filename}", "") for filename in filenames]
        if folder in LEGACY_FOLDERS:
            legacy = f"{model_slug(target)}/{LEGACY_FOLDERS[folder]}"
            note = f"legacy folder {LEGACY_FOLDERS[folder]}/ of {folder}/: "
            paths += [(f"{legacy}/{filename}", note) for filename in filenames]
    return paths
