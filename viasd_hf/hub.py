"""Routing masks on the Hugging Face Hub: one repo holds the masks of many model pairs.

Layout of a masks repo, mirrored by the ``hub_masks/`` folder shipped with viasd_hf::

    <target-slug>/<drafter-slug or self>/routing_mask.json
    <target-slug>/<drafter-slug or self>/search_log.jsonl    (when the search left one)
    README.md                                                (model card listing every pair, generated)

A slug is the model id lowercased with ``/`` replaced by ``--``, so a zoo name such as
``qwen2.5-coder-1.5b-instruct`` stays as it is and ``Qwen/Qwen2.5-Coder-1.5B-Instruct`` becomes
``qwen--qwen2.5-coder-1.5b-instruct``. Masks are small JSON files and go the regular (non-LFS)
upload path.

Where a pair's mask is looked up:

- with an explicit ``repo_id`` or ``revision``: that repo and revision only. A miss is an error;
  the shipped masks never stand in for an explicit request.
- by default (``$VIASD_MASKS_REPO``, else the project's repo; ``main``): that repo, then the
  shipped folder, which is only ever read from disk.

The Hub is asked with one HEAD, a short timeout and no retries; the user cache answers when
offline, with ``local_files_only``, or when the Hub does not answer. An endpoint that does not
answer is not asked again in this process, so offline use never waits on the network, with
``HF_HUB_OFFLINE=1`` or without.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, constants, hf_hub_url
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
from torch import nn

from .cli_args import CommandError, UsageError, check_endpoint, check_output_dir, check_repo_id, first_line
from .masks import MASK_FILENAME, RoutingMask, RoutingMaskError

DEFAULT_MASKS_REPO = "viasd-hf/routing-masks"
MASKS_REPO_ENV = "VIASD_MASKS_REPO"
SEARCH_LOG_FILENAME = "search_log.jsonl"
CARD_FILENAME = "README.md"
CARD_TAGS = ("viasd", "speculative-decoding", "routing-mask", "layer-skipping")
HOW_TO_GET_A_MASK = (
    "To get a mask: search one for the model with `viasd search` (and publish it with `viasd push`), "
    "or download a published one with `viasd pull --target TARGET --drafter DRAFTER --repo-id REPO --out DIR`."
)

# What the Hub client raises when a file cannot be had: missing repo, revision or file,
# offline without a cached copy, an unreachable Hub, or a string that is no repo id.
_HUB_MISSES = (HfHubHTTPError, EntryNotFoundError, OfflineModeIsEnabled, HFValidationError)
# What reading a mask file can raise when the file is malformed (RoutingMaskError is a ValueError,
# and so are JSON and Unicode decoding errors; wrongly typed fields may raise TypeError).
MALFORMED_MASK_ERRORS = (ValueError, TypeError, KeyError, AttributeError)


def _request_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when no answer came back (httpx2 from huggingface_hub 1.x on, else httpx)."""
    errors: list[type[BaseException]] = [OSError]  # OfflineModeIsEnabled and socket errors among them
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).RequestError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


_NO_ANSWER = _request_errors()

# A mask lookup asks the Hub once, with this timeout and no retries (the Hub client itself retries
# a failed HEAD for ~30 s, with a 60 s timeout each, when the file is not cached).
DEFAULT_LOOKUP_TIMEOUT_S = 3.0
# Endpoints that did not answer a mask lookup in this process (connection refused, DNS failure,
# timeout, proxy or TLS error): later lookups read the user cache (and the shipped masks) only.
_UNREACHABLE: set[str] = set()
_UNREACHABLE_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


def model_slug(model_id: str) -> str:
    """The folder name of a model in a masks repo: the id lowercased, ``/`` replaced by ``--``."""
    return model_id.strip().strip("/").lower().replace("/", "--")


def pair_folder(target: str, drafter: str = "self") -> str:
    """The folder of the ``(target, drafter)`` pair in a masks repo (ids or slugs alike)."""
    return f"{model_slug(target)}/{model_slug(drafter or 'self')}"


def mask_path_in_repo(target: str, drafter: str = "self") -> str:
    """Where the mask of the ``(target, drafter)`` pair lives in a masks repo."""
    return f"{pair_folder(target, drafter)}/{MASK_FILENAME}"


def default_masks_repo() -> str:
    """The masks repo to look pairs up in: ``$VIASD_MASKS_REPO``, else the project's public one."""
    return os.environ.get(MASKS_REPO_ENV) or DEFAULT_MASKS_REPO


def shipped_mask_dir() -> Path:
    """The ``hub_masks`` folder shipped with viasd_hf: inside the package when installed from a wheel,
    at the repository root in a source checkout (editable installs included)."""
    package = Path(__file__).resolve().parent
    installed = package / "hub_masks"
    return installed if installed.is_dir() else package.parent / "hub_masks"


def check_pushable(mask: RoutingMask, model: nn.Module | None = None) -> None:
    """Refuse to publish a mask that is inconsistent or, when ``model`` is given, not made for it.

    The dataclass checks run at construction only, so a mask edited since is rebuilt from its
    JSON to run them again (schema, duplicate or out-of-range layers, unknown fields).
    """
    try:
        RoutingMask.from_dict(json.loads(mask.to_json()))
    except TypeError as error:
        raise RoutingMaskError(f"the routing mask does not serialise to JSON: {error}") from error
    if not mask.target_id or not mask.target_fingerprint:
        raise RoutingMaskError(
            "the routing mask lacks the target's id or config fingerprint; build it with RoutingMask.from_model"
        )
    if model is not None:
        mask.validate_for(model)


def push_mask(
    source: RoutingMask | str | Path,
    repo_id: str,
    *,
    target_slug: str | None = None,
    drafter_slug: str | None = None,
    model: nn.Module | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    create_repo: bool = True,
) -> CommitInfo:
    """Publish a mask (a ``RoutingMask``, or a folder/JSON file with ``search_log.jsonl`` beside it) in one commit.

    The commit adds the mask (and its search log, or removes a stale one) and regenerates the
    model card from every mask in the repo. It is made on top of the revision it read the other
    masks from, so a concurrent push makes it fail instead of leaving a card that misses a pair.
    ``revision`` is a branch, created when missing.
    """
    mask, search_log = _mask_and_search_log(source)
    check_pushable(mask, model)
    folder = pair_folder(target_slug or mask.target_id, drafter_slug or mask.drafter_id)
    api = HfApi(endpoint=endpoint, token=token)
    if create_repo:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    head = api.repo_info(repo_id, revision=revision).sha
    files = api.list_repo_files(repo_id, revision=head)
    masks = _masks_in_repo(api, repo_id, head, files)
    masks[f"{folder}/{MASK_FILENAME}"] = mask
    operations: list[CommitOperationAdd | CommitOperationDelete] = [
        CommitOperationAdd(f"{folder}/{MASK_FILENAME}", mask.to_json().encode()),
        CommitOperationAdd(CARD_FILENAME, render_model_card(repo_id, masks).encode()),
    ]
    log_path = f"{folder}/{SEARCH_LOG_FILENAME}"
    if search_log is not None:
        operations.append(CommitOperationAdd(log_path, search_log))
    elif log_path in files:
        operations.append(CommitOperationDelete(log_path))
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message or f"Add routing mask for {folder}",
        revision=revision,
        parent_commit=head,
    )


def pull_mask(
    source: str | tuple[str, str],
    *,
    repo_id: str | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    cache_dir: str | Path | None = None,
) -> RoutingMask:
    """A mask from a Hub repo id (``subfolder`` inside it) or for a ``(target, drafter)`` pair of ids.

    A pair is read from the masks repo ``repo_id`` at ``revision``; when neither is given, from
    :func:`default_masks_repo`, then from :func:`shipped_mask_dir`. The Hub is asked once, briefly
    (see the module docstring); the user cache answers when offline, with ``local_files_only`` or
    when the Hub does not answer. Raises ``RoutingMaskError`` naming every place it looked.
    """
    api = HfApi(endpoint=endpoint, token=token)
    options = {"revision": revision, "local_files_only": local_files_only, "cache_dir": cache_dir}
    if isinstance(source, tuple):
        return _pull_pair(api, *source, repo_id, options)[0]
    if repo_id is not None:
        raise ValueError("repo_id= is for a (target, drafter) pair; pass a repo id as the source itself")
    filename = f"{subfolder.strip('/')}/{MASK_FILENAME}" if subfolder else MASK_FILENAME
    try:
        return _fetch_mask(api, source, filename, options)[0]
    except _HUB_MISSES as error:
        looked = [f"local path {source}: no such folder or file", _hub_miss(api, source, filename, revision, error)]
        raise RoutingMaskError(_not_found(f"no routing mask at {source!r}", looked)) from error


def render_model_card(repo_id: str, masks: Mapping[str, RoutingMask]) -> str:
    """The masks repo's README: YAML front matter, then one table row per pair, so the Hub page says what it holds."""
    tags = "\n".join(f"- {tag}" for tag in CARD_TAGS)
    rows = "\n".join(_card_row(path, mask) for path, mask in sorted(masks.items()))
    return f"""---
library_name: viasd_hf
tags:
{tags}
---

# VIA-SD routing masks

Routing masks for VIA-SD speculative decoding with `viasd_hf`.
A mask names the decoder layers the slim verifier keeps for one target model (and drafter); it
carries the target's config fingerprint and refuses to be applied to any other model.

Layout: `<target-slug>/<drafter-slug or self>/routing_mask.json` (slug: the model id lowercased,
`/` replaced by `--`), with the search log `{SEARCH_LOG_FILENAME}` beside it when there is one.

| Target | Drafter | Layers kept | Skip ratio | Objective | Held-out agreement | Search command |
|---|---|---|---|---|---|---|
{rows}

## Use

```python
from viasd_hf import RoutingMask, routed

mask = RoutingMask.from_pretrained(("<target id>", "<drafter id or self>"), repo_id="{repo_id}")
with routed(model, mask):
    ...
```

or `viasd pull --target <target id> --drafter self --repo-id {repo_id} --out my-mask`.

This card is generated by `viasd push` from the masks in the repo; edits to it are overwritten.
"""


def add_hub_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd push`` and ``viasd pull``."""
    push = subparsers.add_parser("push", help="publish a routing mask (and its search log) to a Hub repo of masks")
    push.add_argument("mask_dir", metavar="MASK_DIR", help=f"folder holding {MASK_FILENAME} (and {SEARCH_LOG_FILENAME})")
    push.add_argument("--repo-id", required=True, help=f"Hub repo of masks, e.g. {DEFAULT_MASKS_REPO}")
    _add_hub_options(push, revision_help="branch to commit to (created if missing; default main)")
    push.set_defaults(handler=_run_push)

    pull = subparsers.add_parser("pull", help="download the routing mask of a target/drafter pair")
    pull.add_argument("--target", required=True, help="target model: Hub id or zoo name")
    pull.add_argument("--drafter", default="self", help='drafter model: Hub id, zoo name or "self" (default)')
    pull.add_argument("--repo-id", help=f"Hub repo of masks (default ${MASKS_REPO_ENV} or {DEFAULT_MASKS_REPO})")
    _add_hub_options(pull, revision_help="branch or commit sha to read (default main)")
    pull.add_argument("--out", required=True, type=Path, help=f"folder to write {MASK_FILENAME} into")
    pull.set_defaults(handler=_run_pull)


def _add_hub_options(parser: argparse.ArgumentParser, revision_help: str) -> None:
    parser.add_argument("--revision", help=revision_help)
    parser.add_argument("--endpoint", help="Hub URL (default $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--token", help="Hub token (default: the one saved by `hf auth login`)")


def _run_push(args: argparse.Namespace) -> int:
    check_repo_id(args.repo_id)
    check_endpoint(args.endpoint)
    source = Path(args.mask_dir).expanduser()
    if not source.exists():  # else RoutingMask.from_pretrained would take it for a Hub id and ask the Hub
        raise UsageError(f"MASK_DIR {args.mask_dir}: no such folder or file")
    try:
        check_pushable(RoutingMask.from_pretrained(source))
    except MALFORMED_MASK_ERRORS as error:
        raise UsageError(f"MASK_DIR {args.mask_dir}: not a valid routing mask: {first_line(error)}") from None
    try:
        commit = push_mask(source, args.repo_id, token=args.token, endpoint=args.endpoint, revision=args.revision)
    except (RoutingMaskError, HfHubHTTPError) as error:
        raise CommandError(f"{args.repo_id}: {first_line(error)}") from error
    except _NO_ANSWER as error:
        raise CommandError(f"the Hub at {args.endpoint or constants.ENDPOINT} did not answer: {first_line(error)}") from error
    print(f"pushed {args.mask_dir} to {args.repo_id}: {commit}")
    return 0


def _run_pull(args: argparse.Namespace) -> int:
    check_repo_id(args.repo_id)
    check_endpoint(args.endpoint)
    for flag, model in (("--target", args.target), ("--drafter", args.drafter)):
        if not model.strip().strip("/"):
            raise UsageError(f"{flag} must name a model")
    check_output_dir(args.out, "--out")
    api = HfApi(endpoint=args.endpoint, token=args.token)
    options = {"revision": args.revision, "local_files_only": False, "cache_dir": None}
    try:
        mask, where = _pull_pair(api, args.target, args.drafter, args.repo_id, options)
    except RoutingMaskError as error:  # a headline, then where it looked and how to get a mask
        raise CommandError(str(error)) from None
    except MALFORMED_MASK_ERRORS as error:
        raise CommandError(f"the routing mask found is not valid: {first_line(error)}") from None
    path = mask.save_pretrained(args.out)
    print(f"wrote {path} (from {where}): keeps {len(mask.kept_layers)} of {mask.num_layers} layers of {mask.target_id}")
    return 0


def _mask_and_search_log(source: RoutingMask | str | Path) -> tuple[RoutingMask, bytes | None]:
    """The mask to push and, when pushing from a folder or file, the search log lying beside it."""
    if isinstance(source, RoutingMask):
        return source, None
    path = Path(source)
    mask = RoutingMask.from_pretrained(path)
    log = (path if path.is_dir() else path.parent) / SEARCH_LOG_FILENAME
    return mask, log.read_bytes() if log.is_file() else None


def _masks_in_repo(api: HfApi, repo_id: str, revision: str, files: list[str]) -> dict[str, RoutingMask]:
    """Every pair's mask in the repo at ``revision``, keyed by path; unreadable ones are left out with a warning."""
    masks = {}
    for path in files:
        if path.count("/") == 2 and path.endswith(f"/{MASK_FILENAME}"):
            local = Path(api.hf_hub_download(repo_id, path, revision=revision))
            try:
                mask = RoutingMask.from_pretrained(local)
                _card_row(path, mask)  # a field of the wrong type would break the card
            except MALFORMED_MASK_ERRORS as error:
                logger.warning("leaving %s out of the model card of %s: it is not a valid routing mask (%s: %s)",
                               path, repo_id, type(error).__name__, error)
                continue
            masks[path] = mask
    return masks


def _download_mask(api: HfApi, repo_id: str, filename: str, options: dict[str, Any]) -> RoutingMask:
    return RoutingMask.from_pretrained(Path(api.hf_hub_download(repo_id, filename, **options)))


def _fetch_mask(api: HfApi, repo_id: str, filename: str, options: dict[str, Any]) -> tuple[RoutingMask, str]:
    """A mask file from the Hub, or from the user cache when the Hub does not answer; and where it came from.

    Raises what the Hub client raises for a miss (``_HUB_MISSES``), the Hub's own "no" included.
    """
    miss, cache_only = _ask_hub_once(api, repo_id, filename, options)
    if miss is not None:
        raise miss
    mask = _download_mask(api, repo_id, filename, options | {"local_files_only": cache_only,
                                                             "etag_timeout": DEFAULT_LOOKUP_TIMEOUT_S})
    where = f"Hub repo {repo_id} at {api.endpoint} (revision {options['revision'] or 'main'})"
    return mask, f"the user cache of {where}" if cache_only else where


def _pull_pair(
    api: HfApi, target: str, drafter: str, repo_id: str | None, options: dict[str, Any]
) -> tuple[RoutingMask, str]:
    """The pair's mask and where it was found (see the module docstring for the order)."""
    filename = mask_path_in_repo(target, drafter)
    headline = f"no routing mask for target {target!r} with drafter {drafter!r}"
    revision = options["revision"]
    explicit = repo_id is not None or revision is not None
    repo_id = repo_id or default_masks_repo()
    try:
        return _fetch_mask(api, repo_id, filename, options)
    except _HUB_MISSES as error:
        looked = [_hub_miss(api, repo_id, filename, revision, error)]
        if explicit:  # that repo and revision, or an error: never a mask the caller did not ask for
            raise RoutingMaskError(
                _not_found(headline, looked) + "\nThe masks shipped with viasd_hf are only used when neither "
                "repo_id nor revision is given."
            ) from error
    shipped = shipped_mask_dir() / filename
    if shipped.is_file():
        return RoutingMask.from_pretrained(shipped), f"the masks shipped with viasd_hf ({shipped})"
    looked.append(f"masks shipped with viasd_hf: no {shipped}")
    raise RoutingMaskError(_not_found(headline, looked))


def _ask_hub_once(
    api: HfApi, repo_id: str, filename: str, options: dict[str, Any]
) -> tuple[Exception | None, bool]:
    """(The Hub's "no", if it said so; whether only the user cache can answer.)

    One HEAD with a short timeout and no retries, where ``hf_hub_download`` alone would retry a
    failed HEAD for ~30 s when the file is not cached. An endpoint that does not answer is
    remembered, so that later lookups in this process read the user cache without waiting on it.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return error, False
    if options["local_files_only"] or constants.HF_HUB_OFFLINE or api.endpoint in _UNREACHABLE:
        return None, True
    url = hf_hub_url(repo_id, filename, revision=options["revision"], endpoint=api.endpoint)
    try:
        api.get_hf_file_metadata(url=url, timeout=DEFAULT_LOOKUP_TIMEOUT_S)
    except HfHubHTTPError as error:  # the Hub answered: no such repo or file, or it is busy or failing
        status = error.response.status_code if error.response is not None else None
        return (None, True) if status == 429 or (status or 0) >= 500 else (error, False)
    except _NO_ANSWER as error:  # no answer at all: connection refused, DNS, timeout, proxy or TLS failure
        with _UNREACHABLE_LOCK:
            _UNREACHABLE.add(api.endpoint)
        logger.warning(
            "the Hub at %s did not answer (%s: %s); routing masks are read from the user cache (and the masks "
            "shipped with viasd_hf) for the rest of this process", api.endpoint, type(error).__name__, error,
        )
        return None, True
    return None, False


def _hub_miss(api: HfApi, repo_id: str, filename: str, revision: str | None, error: Exception) -> str:
    """One line for the not-found message: which repo, file and revision was asked for, and what went wrong."""
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


def _not_found(headline: str, looked: list[str]) -> str:
    places = "\n".join(f"  - {place}" for place in looked)
    return f"{headline}. Looked in:\n{places}\n{HOW_TO_GET_A_MASK}"


def _card_row(path: str, mask: RoutingMask) -> str:
    objective = mask.objective or "—"
    if mask.objective is not None and mask.objective_value is not None:
        objective = f"{mask.objective} = {mask.objective_value:.4g}"
    command = mask.metadata.get("search_command")
    cells = [
        f"[{_cell(mask.target_id)}]({path})",
        _cell(mask.drafter_id),
        f"{len(mask.kept_layers)} / {mask.num_layers}",
        f"{mask.skip_ratio:.1%}",
        _cell(objective),
        _cell(mask.metadata.get("heldout")),
        f"`{_cell(command)}`" if command else "—",
    ]
    return "| " + " | ".join(cells) + " |"


def _cell(value: Any) -> str:
    """A table cell: numbers rounded, dicts as ``key: value`` lists, pipes and newlines escaped."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{key}: {_cell(item)}" for key, item in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")
