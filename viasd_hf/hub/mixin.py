"""``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for objects kept as one JSON file.

In the spirit of PEFT's config classes and huggingface_hub's ``ModelHubMixin``: a routing mask
and a ``ViaSDConfig`` are saved, shared and loaded the way the models they go with are, from a
local folder or file, or a Hub repo (``subfolder``, ``revision``, ``endpoint``, ``token``,
``local_files_only``, ``cache_dir``). A subclass names its file and writes and reads its JSON;
Hub lookups go through :mod:`viasd_hf.hub.files` (one brief HEAD, then the user cache).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi

from viasd_hf.hub.files import (
    HUB_MISSES,
    Lookup,
    commit,
    describe_miss,
    fetch,
    in_folder,
    not_found_message,
    replace_files,
)

T = TypeVar("T", bound="HubMixin")


class HubMixin(ABC):
    """Saving to and loading from a folder or a Hub repo, for an object kept as the JSON file ``hub_filename``."""

    hub_filename: ClassVar[str]
    hub_kind: ClassVar[str]  # what the object is called in messages ("routing mask")
    hub_advice: ClassVar[str]  # how to get one, ending a not-found message
    not_found_error: ClassVar[type[Exception]] = FileNotFoundError
    malformed_error: ClassVar[type[Exception]] = ValueError  # a file that is not UTF-8 JSON

    @abstractmethod
    def to_json(self) -> str:
        """The file's text (sorted keys, so re-saving an unchanged object changes no byte)."""

    @classmethod
    @abstractmethod
    def from_dict(cls: type[T], data: Any) -> T:
        """The object a file's parsed JSON describes; raises naming the first field that is wrong."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Path:
        """Write ``hub_filename`` into ``save_directory`` (made if missing) and return its path. The object is checked
        as it would be read back first, and the file replaced only once written whole: a failed save leaves the old
        file as it was."""
        text = self.checked_json()  # serialised and checked before anything on disk changes
        replace_files(Path(save_directory), {self.hub_filename: text})
        return Path(save_directory) / self.hub_filename

    def checked_json(self) -> str:
        """The file's text, once it reads back: checks run when an object is built, and fields may have changed since."""
        text = self.to_json()
        type(self).from_dict(json.loads(text))
        return text

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str | None = None,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
        revision: str | None = None,
        create_repo: bool = True,
    ) -> CommitInfo:
        """Upload ``hub_filename`` to ``repo_id`` (inside ``subfolder``) in one commit; returns the commit.

        The repo (and ``revision``, a branch) is created when missing unless ``create_repo=False``.
        An object whose fields were changed into something invalid since it was built is refused.
        """
        text = self.checked_json()
        path = in_folder(subfolder, self.hub_filename)
        return commit(
            HfApi(endpoint=endpoint, token=token), repo_id, lambda head: [CommitOperationAdd(path, text.encode())],
            commit_message=commit_message or f"Upload {path}", revision=revision, private=private,
            create_repo=create_repo,
        )  # fmt: skip

    @classmethod
    def from_pretrained(
        cls: type[T],
        source: str | os.PathLike[str],
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        endpoint: str | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        cache_dir: str | Path | None = None,
    ) -> T:
        """Read a local folder or file, else ``hub_filename`` in the Hub repo ``source`` (inside ``subfolder``).

        An existing local path wins; a ``Path`` is always local. The Hub is asked once, briefly; the
        user cache answers when offline, with ``local_files_only`` or when the Hub does not answer.
        Raises ``not_found_error`` naming every place it looked.
        """
        if isinstance(source, os.PathLike) or Path(source).exists():
            return cls._read(Path(source, subfolder or ""))
        api = HfApi(endpoint=endpoint, token=token)
        filename = in_folder(subfolder, cls.hub_filename)
        lookup = Lookup(revision=revision, local_files_only=local_files_only, cache_dir=cache_dir)
        try:
            path, _ = fetch(api, source, filename, lookup)
        except HUB_MISSES as error:
            looked = [f"local path {source}: no such folder or file", describe_miss(api, source, filename, revision, error)]
            message = not_found_message(f"no {cls.hub_kind} at {source!r}", looked, cls.hub_advice)
            raise cls.not_found_error(message) from error
        return cls._read(path)

    @classmethod
    def _read(cls: type[T], path: Path) -> T:
        """The object in a local folder (its ``hub_filename``) or file; errors name the file and what is wrong."""
        file = path / cls.hub_filename if path.is_dir() else path
        if not file.is_file():
            raise cls.not_found_error(
                f"no {cls.hub_kind} at {path} (expected a folder with {cls.hub_filename} or that file)"
            )
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise cls.malformed_error(f"{file} is not a {cls.hub_kind}: it is not UTF-8 text ({error})") from error
        except json.JSONDecodeError as error:
            raise cls.malformed_error(f"{file} is not valid JSON: {error}") from error
        return cls.from_dict(cls.read_beside(data, file.parent))

    @classmethod
    def read_beside(cls, data: Any, folder: Path) -> Any:
        """``data`` as read from a file in ``folder``; a subclass resolves what the file names relative to it."""
        return data
