"""``MaskSet``: a few named routing masks for one target, among which the decoder chooses while decoding.

Which layers a target can skip depends on the text: a mask searched on code may be the best one
for code and a poor one for translation. A set ships several (one per task family, say, plus a
general one); ``viasd_hf.control.mask_chooser`` picks among them online. A set lives in a pair's folder
of a masks repo next to the single mask, which stays its default member, so readers that know
only single masks keep working::

    <pair folder>/routing_mask.json     the default member
    <pair folder>/mask_set.json         {"schema_version": 1, "default": "general",
                                         "members": {"general": "routing_mask.json", "code": "masks/code.json"}}
    <pair folder>/masks/<name>.json     every other member, a routing mask file

Every member is validated against the target exactly as a single mask is.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperation, CommitOperationAdd, CommitOperationDelete, HfApi
from torch import nn

from viasd_hf.hub.files import HUB_MISSES, Lookup, NotFoundError, commit, fetch, in_folder, replace_files
from viasd_hf.masks.card import CARD_FILENAME, render_model_card
from viasd_hf.masks.repo import (
    MASK_FILENAME,
    MASK_SET_FILENAME,
    MEMBERS_FOLDER,
    find_pair_file,
    mask_set_files,
    pair_folder,
)
from viasd_hf.masks.routing_mask import (
    MALFORMED_MASK_ERRORS,
    MaskNotFoundError,
    RoutingMask,
    RoutingMaskError,
    check_pushable,
    mask_records,
    saved_set_files,
    search_log_operations,
)

SCHEMA_VERSION = 1
SINGLE_MEMBER = "default"  # the name a lone routing mask gets when it is read as a set
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


@dataclass
class MaskSet:
    """Named routing masks for one target; ``default`` (else the first given) is the one decoding starts with.

    ``masks`` is kept in one order whatever order it was given in: the default, then the others by
    name, so a set reads back from its files exactly as it was (the chooser probes in that order).
    Renaming ``default`` later is checked, and reorders ``masks``, as construction does.
    """

    masks: dict[str, RoutingMask]
    default: str = ""  # empty: the first member
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.masks, dict) or not self.masks:
            raise RoutingMaskError("a mask set needs a non-empty dict of named routing masks, e.g. {'general': mask}")
        members = {name: _member(name, mask) for name, mask in self.masks.items()}
        self.default = self.default or next(iter(members))
        self.masks = _default_first(members, self.default)
        if not isinstance(self.schema_version, int) or isinstance(self.schema_version, bool):
            raise RoutingMaskError(f"a mask set's schema_version must be an int, got {self.schema_version!r} "
                                   f"({type(self.schema_version).__name__}); leave it out for this version's")
        if self.schema_version > SCHEMA_VERSION:
            raise RoutingMaskError(f"mask set schema {self.schema_version!r} is not one this viasd_hf reads; upgrade viasd_hf")
        first_name, first = next(iter(self.masks.items()))
        for name, mask in self.masks.items():
            if (mask.num_layers, mask.target_fingerprint) != (first.num_layers, first.target_fingerprint):
                raise RoutingMaskError(
                    f"mask set members {first_name!r} ({first.target_id}) and {name!r} ({mask.target_id}) are for "
                    "different targets: a mask set holds masks of one target"
                )
        seen: dict[tuple[int, ...], str] = {}
        for name, mask in self.masks.items():
            twin = seen.setdefault(tuple(mask.kept_layers), name)
            if twin != name:
                raise RoutingMaskError(f"mask set members {twin!r} and {name!r} keep the same layers; drop one")
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "default" and self.__dict__.get("_built"):
            self.masks = _default_first(self.masks, value)
        super().__setattr__(name, value)

    @property
    def default_mask(self) -> RoutingMask:
        return self.masks[self.default]

    def validate_for(self, model: nn.Module) -> None:
        """Raise ``RoutingMaskError`` naming the first member not made for ``model`` (``RoutingMask.validate_for``)."""
        for name, mask in self.masks.items():
            try:
                mask.validate_for(model)
            except RoutingMaskError as error:
                raise RoutingMaskError(f"mask set member {name!r}: {error}") from None

    def files(self) -> dict[str, str]:
        """Each member's file, relative to the set's folder: the default is the single-mask file."""
        return {name: MASK_FILENAME if name == self.default else f"{MEMBERS_FOLDER}/{name}.json" for name in self.masks}

    def index_json(self) -> str:
        """The ``mask_set.json`` text (sorted keys, so re-saving an unchanged set changes no byte)."""
        index = {"schema_version": self.schema_version, "default": self.default, "members": self.files()}
        return json.dumps(index, indent=2, sort_keys=True) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The set with its masks inline, as a ``ViaSDConfig`` embeds it."""
        return {"schema_version": self.schema_version, "default": self.default,
                "masks": {name: mask.to_dict() for name, mask in self.masks.items()}}

    @classmethod
    def from_dict(cls, data: Any) -> MaskSet:
        """The inverse of ``to_dict``."""
        if not isinstance(data, dict) or not isinstance(data.get("masks"), dict):
            raise RoutingMaskError("an inline mask set must be a JSON object with a 'masks' object of named routing masks")
        unknown = sorted(set(data) - {"schema_version", "default", "masks"})
        if unknown:
            raise RoutingMaskError(f"unknown mask set fields {unknown}; is it from a newer viasd_hf?")
        return cls(**data)

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Path:
        """Write the members and ``mask_set.json`` into ``save_directory`` (made if missing); returns the index's path.

        A set saved there before is replaced, so no stale member stays beside this set's: every member is serialised
        and checked first, then the new files and the old set's removal are one change (``hub.files.replace_files``),
        so a save that fails leaves the old set exactly as it was.
        """
        directory = Path(save_directory)
        texts = {file: self.masks[name].checked_json() for name, file in self.files().items()}
        texts[MASK_SET_FILENAME] = self.index_json()
        replace_files(directory, texts, saved_set_files(directory))
        return directory / MASK_SET_FILENAME

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike[str] | tuple[str, str],
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        repo_id: str | None = None,
        endpoint: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        cache_dir: str | Path | None = None,
    ) -> MaskSet:
        """A set from a local folder, a Hub repo id (``subfolder`` inside it) or a ``(target, drafter)`` pair.

        Looked up like ``RoutingMask.from_pretrained``; in each place a ``mask_set.json`` is read
        before a single ``routing_mask.json``, which is read as a set of one (its member is
        called ``"default"``). Raises ``RoutingMaskError`` naming every place it looked.
        """
        if isinstance(source, tuple):
            return cls.find_for_pair(
                *source, repo_id=repo_id, revision=revision, endpoint=endpoint, token=token,
                local_files_only=local_files_only, cache_dir=cache_dir,
            )[0]  # fmt: skip
        api = HfApi(endpoint=endpoint, token=token)
        lookup = Lookup(revision=revision, local_files_only=local_files_only, cache_dir=cache_dir)
        if repo_id is not None:
            raise ValueError("repo_id= is for a (target, drafter) pair; pass a repo id as the source itself")
        path = Path(source, subfolder or "")
        if isinstance(source, os.PathLike) or Path(source).exists():
            index = path if path.is_file() and path.name == MASK_SET_FILENAME else path / MASK_SET_FILENAME
            if index.is_file():
                return _read_index(index, lambda file: index.parent / file)
        else:
            try:
                index, _ = fetch(api, source, in_folder(subfolder, MASK_SET_FILENAME), lookup)
                return _read_index(index, lambda file: fetch(api, source, in_folder(subfolder, file), lookup)[0])
            except HUB_MISSES:
                pass  # no set there: a single mask, or the single mask's own not-found error
        single = RoutingMask.from_pretrained(
            source, subfolder=subfolder, revision=revision, endpoint=endpoint, token=token,
            local_files_only=local_files_only, cache_dir=cache_dir,
        )  # fmt: skip
        return cls({SINGLE_MEMBER: single})

    @classmethod
    def find_for_pair(
        cls,
        target: str,
        drafter: str = "self",
        *,
        repo_id: str | None = None,
        revision: str | None = None,
        endpoint: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        cache_dir: str | Path | None = None,
    ) -> tuple[MaskSet, str]:
        """The ``(target, drafter)`` pair's set and where it was found, looked up as ``RoutingMask.find_for_pair``.

        In each place a ``mask_set.json`` is read before a lone ``routing_mask.json`` (a set of one,
        its member called ``"default"``). Raises ``RoutingMaskError`` naming every place it looked.
        """
        api = HfApi(endpoint=endpoint, token=token)
        lookup = Lookup(revision=revision, local_files_only=local_files_only, cache_dir=cache_dir)
        try:
            found = find_pair_file(api, target, drafter, repo_id, lookup, (MASK_SET_FILENAME, MASK_FILENAME))
        except NotFoundError as error:
            raise MaskNotFoundError(str(error)) from error
        if found.path.name == MASK_FILENAME:
            return cls({SINGLE_MEMBER: RoutingMask.from_pretrained(found.path)}), found.where
        if found.repo_id is None:
            return _read_index(found.path, lambda file: found.path.parent / file), found.where
        folder = found.path_in_repo.rsplit("/", 1)[0]
        return _read_index(found.path, lambda file: fetch(api, found.repo_id, f"{folder}/{file}", lookup)[0]), found.where

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str | None = None,
        target_slug: str | None = None,
        drafter_slug: str | None = None,
        model: nn.Module | None = None,
        search_log: bytes | None = None,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
        revision: str | None = None,
        create_repo: bool = True,
    ) -> CommitInfo:
        """Publish the set in one commit to its pair's folder (as ``RoutingMask.push_to_hub`` places a mask).

        The default member replaces the folder's ``routing_mask.json`` and ``search_log`` its search
        log (or a stale log is removed, as a pushed mask does); members of an earlier set that this
        one lacks are removed; the repo's model card is regenerated. Every member is checked as a
        pushed mask is (``check_pushable``).
        """
        if subfolder is not None and (target_slug or drafter_slug):
            raise ValueError("pass either subfolder= or target_slug=/drafter_slug=, not both")
        self.check_pushable(model)
        default = self.default_mask
        folder = (subfolder or "").strip("/") or pair_folder(target_slug or default.target_id, drafter_slug or default.drafter_id)
        api = HfApi(endpoint=endpoint, token=token)
        return commit(
            api, repo_id, lambda head: self._repo_operations(api, repo_id, head, folder, search_log),
            commit_message=commit_message or f"Add a set of {len(self.masks)} routing masks for {folder}",
            revision=revision, private=private, create_repo=create_repo,
        )  # fmt: skip

    def check_pushable(self, model: nn.Module | None = None) -> None:
        """Refuse a set with a member that a mask push would refuse (``routing_mask.check_pushable``), naming it."""
        for name, mask in self.masks.items():
            try:
                check_pushable(mask, model)
            except RoutingMaskError as error:
                raise RoutingMaskError(f"mask set member {name!r}: {error}") from None

    def _repo_operations(
        self, api: HfApi, repo_id: str, head: str, folder: str, search_log: bytes | None
    ) -> list[CommitOperation]:
        files = api.list_repo_files(repo_id, revision=head)
        ours = {f"{folder}/{file}": self.masks[name] for name, file in self.files().items()}
        records = mask_records(api, repo_id, head, files) | {f"{folder}/{MASK_FILENAME}": self.default_mask.to_dict()}
        operations: list[CommitOperation] = [CommitOperationAdd(path, mask.to_json().encode()) for path, mask in ours.items()]
        index = f"{folder}/{MASK_SET_FILENAME}"
        operations.append(CommitOperationAdd(index, self.index_json().encode()))
        operations.append(CommitOperationAdd(CARD_FILENAME, render_model_card(repo_id, records).encode()))
        stale = [path for path in mask_set_files(files, folder) if path not in ours and path != index]
        return operations + search_log_operations(files, folder, search_log) + [CommitOperationDelete(path) for path in stale]


def _default_first(members: dict[str, RoutingMask], default: Any) -> dict[str, RoutingMask]:
    """``members`` in a set's one order (JSON files sort their keys): ``default``, then the others by name."""
    if not isinstance(default, str) or default not in members:
        raise RoutingMaskError(f"the mask set's default {default!r} is not one of its members {list(members)}")
    return {name: members[name] for name in [default, *sorted(set(members) - {default})]}


def _member(name: Any, mask: Any) -> RoutingMask:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RoutingMaskError(
            f"mask set member name {name!r} must be lowercase letters, digits, '.', '_' or '-' (at most 64), "
            "e.g. 'general', 'code', 'translation'"
        )
    if isinstance(mask, dict):
        return RoutingMask.from_dict(mask)
    if not isinstance(mask, RoutingMask):
        raise RoutingMaskError(f"mask set member {name!r} must be a RoutingMask, got {type(mask).__name__}")
    return mask


def _read_index(index: Path, member_file: Callable[[str], Path]) -> MaskSet:
    """The set ``index`` (a ``mask_set.json``) describes, each member read from ``member_file(its relative path)``."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RoutingMaskError(f"{index} is not a mask set index (UTF-8 JSON): {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("members"), dict) or set(data) - {"schema_version", "default", "members"}:
        raise RoutingMaskError(f"{index}: a mask set index holds 'schema_version', 'default' and a 'members' object")
    masks = {}
    for name, file in data["members"].items():
        if not isinstance(file, str) or file.startswith("/") or ".." in Path(file).parts:
            raise RoutingMaskError(f"{index}: member {name!r} names {file!r}, not a file inside the set's folder")
        try:
            masks[name] = RoutingMask.from_pretrained(member_file(file))
        except HUB_MISSES as error:
            raise RoutingMaskError(f"{index}: member {name!r} ({file}) is missing: {error}") from error
        except MALFORMED_MASK_ERRORS as error:
            raise RoutingMaskError(f"{index}: member {name!r} ({file}): {error}") from error
    return MaskSet(masks, data.get("default", ""), data.get("schema_version", SCHEMA_VERSION))
