"""Files on the Hugging Face Hub: asked for once and briefly, and published in one commit.

Why this exists: ``hf_hub_download`` alone retries a failed HEAD for ~30 s (with a 60 s timeout
each) when the file is not cached, and ``generate`` may look a routing mask up on its first call.
Here the Hub is asked with one HEAD, a short timeout and no retries; the user cache answers when
offline, with ``local_files_only``, or when the Hub does not answer. An endpoint that does not
answer is not asked again in this process, so offline use never waits on the network, with
``HF_HUB_OFFLINE=1`` or without. Nothing here knows what the files hold.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypedDict

from huggingface_hub import CommitInfo, CommitOperation, HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

# A lookup asks the Hub once, with this timeout and no retries.
DEFAULT_LOOKUP_TIMEOUT_S = 3.0

# What the Hub client raises when a file cannot be had: missing repo, revision or file,
# offline without a cached copy, an unreachable Hub, or a string that is no repo id.
HUB_MISSES = (HfHubHTTPError, EntryNotFoundError, OfflineModeIsEnabled, HFValidationError)


def replace_files(directory: Path, texts: dict[str, str], stale: Iterable[str] = ()) -> None:
    """Write ``texts`` (file name relative to ``directory`` -> text) and delete the ``stale`` files there, as one
    change: every new file is written in a staging folder first, then the files it replaces and the stale ones are
    moved aside and the new ones moved in. A failure at any step moves the old files back, so the folder holds
    either all of its old files or all of the new ones, never a mixture. Folders emptied of stale files are removed."""
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".viasd-save-", dir=directory))  # same file system: moves are renames
    aside, placed = [], []
    try:
        for name, text in texts.items():
            (staging / "new" / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / "new" / name).write_text(text)
        for name in dict.fromkeys([*texts, *stale]):
            if (directory / name).is_file():
                (staging / "old" / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(directory / name, staging / "old" / name)
                aside.append(name)
        for name in texts:
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / "new" / name, directory / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            (directory / name).unlink(missing_ok=True)
        for name in aside:
            os.replace(staging / "old" / name, directory / name)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in stale:
        for folder in (directory / name).parents:
            if folder == directory or not folder.is_relative_to(directory) or any(folder.iterdir()):
                break
            folder.rmdir()


def viasd_home() -> Path:
    """viasd_hf's own cache root (built-in models, measurements, calibration windows): ``$VIASD_HOME``, else
    ``~/.cache/viasd_hf``."""
    return Path(os.environ.get("VIASD_HOME") or Path.home() / ".cache" / "viasd_hf").expanduser()


def _request_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when no answer came back (httpx2 from huggingface_hub 1.x on, else httpx)."""
    errors: list[type[BaseException]] = [OSError]  # OfflineModeIsEnabled and socket errors among them
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).RequestError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


NO_ANSWER = _request_errors()

# Endpoints that did not answer a lookup in this process (connection refused, DNS failure,
# timeout, proxy or TLS error): later lookups read the user cache only.
_UNREACHABLE: set[str] = set()
_UNREACHABLE_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


class Lookup(TypedDict):
    """Which copy of a file to read: ``hf_hub_download``'s options of the same names."""

    revision: str | None
    local_files_only: bool
    cache_dir: str | Path | None


class NotFoundError(LookupError):
    """Nothing was found at any of the places looked in; the message names each of them."""


def in_folder(subfolder: str | None, filename: str) -> str:
    """``filename``'s path in a repo, inside ``subfolder`` when one is given."""
    return f"{subfolder.strip('/')}/{filename}" if subfolder and subfolder.strip("/") else filename


def fetch(api: HfApi, repo_id: str, filename: str, lookup: Lookup) -> tuple[Path, str]:
    """A file from the Hub, or from the user cache when the Hub does not answer; and where it came from.

    Raises what the Hub client raises for a miss (``HUB_MISSES``), the Hub's own "no" included.
    """
    miss, cache_only = _ask_hub_once(api, repo_id, filename, lookup)
    if miss is not None:
        raise miss
    options = lookup | {"local_files_only": cache_only, "etag_timeout": DEFAULT_LOOKUP_TIMEOUT_S}
    path = Path(api.hf_hub_download(repo_id, filename, **options))
    where = f"Hub repo {repo_id} at {api.endpoint} (revision {lookup['revision'] or 'main'})"
    return path, f"the user cache of {where}" if cache_only else where


def describe_miss(api: HfApi, repo_id: str, filename: str, revision: str | None, error: Exception) -> str:
    """One line for a not-found message: which repo, file and revision was asked for, and what went wrong."""
    if isinstance(error, RepositoryNotFoundError):
        reason = "repository not found (or private: pass a token)"
    elif isinstance(error, RevisionNotFoundError):
        reason = f"revision {revision!r} not found"
    elif isinstance(error, LocalEntryNotFoundError):
        reason = "not in the local cache, and the Hub was not reachable (offline mode, local_files_only or no connection)"
    elif isinstance(error, EntryNotFoundError):
        reason = "no such file"
    elif isinstance(error, HFValidationError):
        reason = "not a valid repo id"
    else:
        reason = str(error).strip().splitlines()[0]
    return f"Hub repo {repo_id} at {api.endpoint} (revision {revision or 'main'}), {filename}: {reason}"


def not_found_message(headline: str, looked: list[str], advice: str) -> str:
    """The headline, every place looked in, then how to get the file."""
    places = "\n".join(f"  - {place}" for place in looked)
    return f"{headline}. Looked in:\n{places}\n{advice}"


def commit(
    api: HfApi,
    repo_id: str,
    operations_for: Callable[[str], list[CommitOperation]],
    *,
    commit_message: str,
    revision: str | None,
    private: bool | None,
    create_repo: bool,
) -> CommitInfo:
    """One commit of ``operations_for(head)``, made on top of ``head``, the revision they were computed from.

    So a concurrent push makes this one fail instead of being silently overwritten. ``revision``
    is a branch, created when missing (with the repo) when ``create_repo``.
    """
    if create_repo:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    head = api.repo_info(repo_id, revision=revision).sha
    return api.create_commit(
        repo_id, operations_for(head), commit_message=commit_message, revision=revision, parent_commit=head
    )


def _ask_hub_once(api: HfApi, repo_id: str, filename: str, lookup: Lookup) -> tuple[Exception | None, bool]:
    """(The Hub's "no", if it said so; whether only the user cache can answer.)

    One HEAD with a short timeout and no retries. An endpoint that does not answer is remembered,
    so that later lookups in this process read the user cache without waiting on it.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return error, False
    if lookup["local_files_only"] or constants.HF_HUB_OFFLINE or api.endpoint in _UNREACHABLE:
        return None, True
    url = hf_hub_url(repo_id, filename, revision=lookup["revision"], endpoint=api.endpoint)
    try:
        api.get_hf_file_metadata(url=url, timeout=DEFAULT_LOOKUP_TIMEOUT_S)
    except HfHubHTTPError as error:  # the Hub answered: no such repo or file, or it is busy or failing
        status = error.response.status_code if error.response is not None else None
        return (None, True) if status == 429 or (status or 0) >= 500 else (error, False)
    except NO_ANSWER as error:  # no answer at all: connection refused, DNS, timeout, proxy or TLS failure
        with _UNREACHABLE_LOCK:
            _UNREACHABLE.add(api.endpoint)
        logger.warning(
            "the Hub at %s did not answer (%s: %s); files (routing masks, configs) are read from the user cache "
            "for the rest of this process", api.endpoint, type(error).__name__, error,
        )
        return None, True
    return None, False
