"""Routing masks: which decoder layers the slim verifier keeps, and for which model pair.

A mask is only meaningful for the model it was searched on, so it carries that model's
identity (id, revision, config fingerprint, layer count) and refuses to be applied to any
other. It also records how it was found, so a mask pulled from the Hub explains itself.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperation, CommitOperationAdd, CommitOperationDelete, HfApi
from torch import nn

from viasd_hf.hub.files import Lookup, NotFoundError, commit, replace_files
from viasd_hf.hub.mixin import HubMixin
from viasd_hf.masks.architectures import config_fingerprint, model_config, num_decoder_layers, protected_layers
from viasd_hf.masks.card import CARD_FILENAME, card_row, render_model_card
from viasd_hf.masks.repo import (
    HOW_TO_GET_A_MASK,
    MASK_FILENAME,
    MASK_SET_FILENAME,
    MEMBERS_FOLDER,
    SEARCH_LOG_FILENAME,
    find_pair_file,
    mask_set_files,
    pair_folder,
)
from viasd_hf.validation import INT, JSON_OBJECT, REAL, STR, check_fields, is_int, wrong_type
from viasd_hf.version import __version__

SCHEMA_VERSION = 1

logger = logging.getLogger(__name__)


class RoutingMaskError(ValueError):
    """A routing mask that is malformed or does not belong to the model it is applied to."""


class MaskNotFoundError(RoutingMaskError):
    """No routing mask where one was looked for (the message names every place, and how to get one)."""


# What reading a mask file can raise when the file is malformed (RoutingMaskError is a ValueError,
# and so are JSON and Unicode decoding errors; wrongly typed fields may raise TypeError).
MALFORMED_MASK_ERRORS = (ValueError, TypeError, KeyError, AttributeError)


# Field types as a mask file must spell them (JSON has no int/bool/float coercion worth trusting).
_FIELD = "routing mask field {!r}"
_COUNTS = ((("num_layers", "schema_version"), INT),)
_FIELD_TYPES = (
    (("target_id", "target_fingerprint", "drafter_id", "library_version"), STR),
    (("target_revision", "objective", "calibration"), STR.or_none("null")),
    (("alpha1", "alpha2"), REAL),
    (("objective_value", "skip_ratio", "search_time_s"), REAL.or_none("null")),
    (("metadata",), JSON_OBJECT),
)


@dataclass
class RoutingMask(HubMixin):
    """The layers a slim verifier keeps, the model pair it belongs to, and how it was found."""

    hub_filename = MASK_FILENAME
    hub_kind = "routing mask"
    hub_advice = HOW_TO_GET_A_MASK
    not_found_error = MaskNotFoundError
    malformed_error = RoutingMaskError

    kept_layers: list[int]
    num_layers: int
    target_id: str
    target_fingerprint: str
    target_revision: str | None = None
    drafter_id: str = "self"
    objective: str | None = None
    objective_value: float | None = None
    alpha1: float = 0.5
    alpha2: float = 0.3
    skip_ratio: float | None = None
    calibration: str | None = None
    search_time_s: float | None = None
    library_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_types()
        self.kept_layers = sorted(int(layer) for layer in self.kept_layers)
        if len(set(self.kept_layers)) != len(self.kept_layers):
            raise RoutingMaskError(f"kept_layers has duplicates: {self.kept_layers}")
        out_of_range = [layer for layer in self.kept_layers if not 0 <= layer < self.num_layers]
        if out_of_range:
            raise RoutingMaskError(
                f"kept_layers {out_of_range} are outside 0..{self.num_layers - 1} for a {self.num_layers}-layer model"
            )
        if not self.kept_layers:
            raise RoutingMaskError("a routing mask must keep at least one layer")
        if self.skip_ratio is None:
            self.skip_ratio = len(self.skipped_layers) / self.num_layers
        if self.schema_version > SCHEMA_VERSION:
            raise RoutingMaskError(
                f"routing mask schema {self.schema_version} is newer than this viasd_hf understands "
                f"({SCHEMA_VERSION}); upgrade viasd_hf"
            )

    def _check_types(self) -> None:
        """Raise ``RoutingMaskError`` naming the first field whose type is wrong; nothing is coerced silently."""
        if not isinstance(self.kept_layers, (list, tuple, range)):
            expected = "a list of layer indices (ints)"
            raise wrong_type(_FIELD.format("kept_layers"), expected, self.kept_layers, RoutingMaskError)
        for layer in self.kept_layers:
            if not is_int(layer):
                raise RoutingMaskError(
                    f"routing mask field 'kept_layers' must hold layer indices (ints), got {layer!r} "
                    f"({type(layer).__name__}) in {list(self.kept_layers)!r}"
                )
        check_fields(self, _COUNTS, _FIELD, RoutingMaskError)
        if self.num_layers < 1:
            raise RoutingMaskError(f"routing mask field 'num_layers' must be >= 1, got {self.num_layers}")
        check_fields(self, _FIELD_TYPES, _FIELD, RoutingMaskError)

    @property
    def skipped_layers(self) -> list[int]:
        kept = set(self.kept_layers)
        return [layer for layer in range(self.num_layers) if layer not in kept]

    @classmethod
    def from_model(
        cls, model: nn.Module, skip: list[int] | tuple[int, ...], drafter_id: str = "self", **found_by: Any
    ) -> RoutingMask:
        """A mask skipping ``skip`` on ``model``, with the target's identity filled in from the model."""
        num_layers = num_decoder_layers(model)
        unknown = set(skip) - set(range(num_layers))
        if unknown:
            raise RoutingMaskError(f"cannot skip layers {sorted(unknown)}: the model has layers 0..{num_layers - 1}")
        config = model_config(model)
        mask = cls(
            kept_layers=[layer for layer in range(num_layers) if layer not in set(skip)],
            num_layers=num_layers,
            target_id=str(getattr(config, "_name_or_path", "") or type(model).__name__),
            target_fingerprint=config_fingerprint(model),
            target_revision=getattr(config, "_commit_hash", None),
            drafter_id=drafter_id,
            **found_by,
        )
        mask.validate_for(model)
        return mask

    def validate_for(self, model: nn.Module) -> None:
        """Raise ``RoutingMaskError`` unless this mask was made for ``model`` and skips no protected layer."""
        num_layers = num_decoder_layers(model)
        if num_layers != self.num_layers:
            raise RoutingMaskError(
                f"this routing mask is for a {self.num_layers}-layer model ({self.target_id}), but the model has "
                f"{num_layers} decoder layers; use a mask searched for this model (`viasd search` or `viasd pull`)"
            )
        fingerprint = config_fingerprint(model)
        if fingerprint != self.target_fingerprint:
            raise RoutingMaskError(
                f"this routing mask is for {self.target_id} (config fingerprint {self.target_fingerprint}), but the "
                f"model's config fingerprint is {fingerprint} ({getattr(model_config(model), '_name_or_path', '?')}); "
                "use a mask searched for this model (`viasd search` or `viasd pull`)"
            )
        for layer, reason in protected_layers(model).items():
            if layer not in self.kept_layers:
                raise RoutingMaskError(f"the routing mask skips layer {layer}, which must be kept: it is {reason}")

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Path:
        """Write ``routing_mask.json`` into ``save_directory`` (made if missing) and return its path.

        A mask set saved there before (``viasd_hf.masks.mask_set``) is removed: the folder would otherwise read
        as that set, with this mask as its default beside stale members the chooser could switch to.
        As transformers' ``save_pretrained`` drops a previous save's stale weight files, the folder then
        holds this one mask; save a ``MaskSet`` to keep a set. The mask is serialised and checked before anything
        is removed, and the mask and the set's removal are one change (``hub.files.replace_files``): a save that fails
        leaves the folder as it was.
        """
        text = self.checked_json()
        directory = Path(save_directory)
        stale = saved_set_files(directory)
        if stale:
            logging.getLogger("viasd_hf").warning(  # the user's one line, not this module's own logger
                "viasd_hf: %s held a mask set; it now holds this one mask (save a MaskSet to keep a set)", save_directory)
        replace_files(directory, {MASK_FILENAME: text}, stale)
        return directory / MASK_FILENAME

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """The ``routing_mask.json`` text (sorted keys, so re-saving an unchanged mask changes no byte)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingMask:
        if not isinstance(data, dict):
            raise RoutingMaskError(f"a routing mask must be a JSON object of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RoutingMaskError(f"unknown routing mask fields {unknown}; is it from a newer viasd_hf?")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise RoutingMaskError(f"the routing mask lacks required fields {missing}")
        return cls(**data)

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
    ) -> RoutingMask:
        """Read a mask from a local folder or JSON file, a Hub repo id, or a ``(target, drafter)`` pair of ids.

        An existing local path wins. Otherwise the Hub is asked (the user cache answers when
        offline or with ``local_files_only``): ``source`` as a repo id (``subfolder`` inside it),
        or, for a pair, the masks repo ``repo_id`` (default ``$VIASD_MASKS_REPO``) then the masks
        shipped with viasd_hf: see :meth:`find_for_pair`.
        """
        if isinstance(source, tuple):
            return cls.find_for_pair(
                *source, repo_id=repo_id, revision=revision, endpoint=endpoint, token=token,
                local_files_only=local_files_only, cache_dir=cache_dir,
            )[0]  # fmt: skip
        if repo_id is not None:
            raise ValueError("repo_id= is for a (target, drafter) pair; pass a repo id as the source itself")
        return super().from_pretrained(
            source, subfolder=subfolder, revision=revision, endpoint=endpoint, token=token,
            local_files_only=local_files_only, cache_dir=cache_dir,
        )  # fmt: skip

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
    ) -> tuple[RoutingMask, str]:
        """The mask of the ``(target, drafter)`` pair, and where it was found.

        ``drafter`` is a drafter model's id, ``"self"`` (the slim verifier's mask when no drafter
        model runs: prompt lookup or the self-drafter) or ``"self-drafter"`` (the self-drafter's own
        drafting mask); see ``viasd_hf.masks.repo`` for their folders. The pair is read from
        the masks repo ``repo_id`` at ``revision``; when neither is given, from ``$VIASD_MASKS_REPO``
        (else the project's repo), then from the masks shipped with viasd_hf (``viasd_hf.masks.repo``).
        Raises ``RoutingMaskError`` naming every place it looked.
        """
        api = HfApi(endpoint=endpoint, token=token)
        lookup = Lookup(revision=revision, local_files_only=local_files_only, cache_dir=cache_dir)
        try:
            found = find_pair_file(api, target, drafter, repo_id, lookup)
        except NotFoundError as error:
            raise MaskNotFoundError(str(error)) from error
        return cls._read(found.path), found.where

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
        """Publish this mask (and ``search_log``) to a Hub repo of masks and refresh the repo's model card.

        It lands at ``<target-slug>/<drafter folder>/routing_mask.json`` (``viasd_hf.masks.repo``;
        the slugs default to the ids in the mask), or in ``subfolder``. One commit adds the mask
        and its search log (or removes a stale one), removes a mask set published there (as
        ``save_pretrained`` does locally), and regenerates the card from every mask in
        the repo, on top of the revision it read them from, so a concurrent push makes it fail
        instead of leaving a card that misses a pair. A mask that is inconsistent, or not made
        for ``model`` when one is given, is refused. ``revision`` is a branch, created when
        missing. Returns the commit (a ``str``, its URL; ``.oid`` is the commit sha).
        """
        if subfolder is not None and (target_slug or drafter_slug):
            raise ValueError("pass either subfolder= or target_slug=/drafter_slug=, not both")
        check_pushable(self, model)
        target, drafter = target_slug or self.target_id, drafter_slug or self.drafter_id
        folder = (subfolder or "").strip("/") or pair_folder(target, drafter)
        api = HfApi(endpoint=endpoint, token=token)
        return commit(
            api, repo_id, lambda head: self._repo_operations(api, repo_id, head, folder, search_log),
            commit_message=commit_message or f"Add routing mask for {folder}", revision=revision, private=private,
            create_repo=create_repo,
        )  # fmt: skip

    def _repo_operations(
        self, api: HfApi, repo_id: str, head: str, folder: str, search_log: bytes | None
    ) -> list[CommitOperation]:
        """What a push commits on top of ``head``: this mask, the regenerated card, the search log (or its removal),
        and the removal of a mask set's other files in ``folder``."""
        files = api.list_repo_files(repo_id, revision=head)
        path = f"{folder}/{MASK_FILENAME}"
        records = mask_records(api, repo_id, head, files) | {path: self.to_dict()}
        operations: list[CommitOperation] = [
            CommitOperationAdd(path, self.to_json().encode()),
            CommitOperationAdd(CARD_FILENAME, render_model_card(repo_id, records).encode()),
        ]
        stale_set = [CommitOperationDelete(stale) for stale in mask_set_files(files, folder)]
        return operations + search_log_operations(files, folder, search_log) + stale_set


def search_log_operations(files: list[str], folder: str, search_log: bytes | None) -> list[CommitOperation]:
    """Upload ``search_log`` into ``folder``, or remove the log there: it told how the mask being replaced was found."""
    path = f"{folder}/{SEARCH_LOG_FILENAME}"
    if search_log is not None:
        return [CommitOperationAdd(path, search_log)]
    return [CommitOperationDelete(path)] if path in files else []


def saved_set_files(directory: Path) -> list[str]:
    """The files of a mask set saved in ``directory`` but its default member (``routing_mask.json``), relative to it:
    its index and its members' files; none where no set is saved there."""
    if not (directory / MASK_SET_FILENAME).is_file():
        return []
    members = sorted(path.relative_to(directory).as_posix() for path in (directory / MEMBERS_FOLDER).glob("*.json"))
    return [MASK_SET_FILENAME, *members]


def check_pushable(mask: RoutingMask, model: nn.Module | None = None) -> None:
    """Refuse to publish a mask that is inconsistent or, when ``model`` is given, not made for it.

    The dataclass checks run at construction only, so a mask edited since is rebuilt from its
    JSON to run them again (schema, duplicate or out-of-range layers, unknown fields).
    """
    try:
        mask.checked_json()
    except TypeError as error:
        raise RoutingMaskError(f"the routing mask does not serialise to JSON: {error}") from error
    if not mask.target_id or not mask.target_fingerprint:
        raise RoutingMaskError(
            "the routing mask lacks the target's id or config fingerprint; build it with RoutingMask.from_model"
        )
    if model is not None:
        mask.validate_for(model)


def mask_records(api: HfApi, repo_id: str, revision: str, files: list[str]) -> dict[str, dict[str, Any]]:
    """Every pair's mask record in the repo at ``revision``, keyed by path; unreadable ones are left out with a warning."""
    records = {}
    for path in files:
        if path.count("/") == 2 and path.endswith(f"/{MASK_FILENAME}"):
            local = Path(api.hf_hub_download(repo_id, path, revision=revision))
            try:
                record = RoutingMask.from_pretrained(local).to_dict()
                card_row(path, record)  # a value the card cannot show would break it
            except MALFORMED_MASK_ERRORS as error:
                logger.warning("leaving %s out of the model card of %s: it is not a valid routing mask (%s: %s)",
                               path, repo_id, type(error).__name__, error)
                continue
            records[path] = record
    return records
