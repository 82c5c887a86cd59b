"""``viasd push`` and ``viasd pull``: routing masks and mask sets to and from a Hub repo of masks, one pair at a time."""

from __future__ import annotations

import argparse
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError

from viasd_hf.cli.args import CommandError, UsageError, check_endpoint, check_output_dir, check_repo_id, first_line
from viasd_hf.hub.files import NO_ANSWER
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.masks.publish import push_mask, read_pushable
from viasd_hf.masks.repo import (
    DEFAULT_MASKS_REPO,
    MASK_FILENAME,
    MASK_SET_FILENAME,
    MASKS_REPO_ENV,
    SEARCH_LOG_FILENAME,
)
from viasd_hf.masks.routing_mask import MALFORMED_MASK_ERRORS, RoutingMaskError


def add_hub_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd push`` and ``viasd pull``."""
    push = subparsers.add_parser("push", help="publish a routing mask or mask set (and its search log) to a Hub repo of masks")
    push.add_argument("mask_dir", metavar="MASK_DIR",
                      help=f"folder holding {MASK_FILENAME} (and {SEARCH_LOG_FILENAME}); with {MASK_SET_FILENAME}, the "
                           "whole mask set is published")  # fmt: skip
    push.add_argument("--repo-id", required=True, help=f"Hub repo of masks, e.g. {DEFAULT_MASKS_REPO}")
    _add_hub_options(push, revision_help="branch to commit to (created if missing; default main)")
    push.set_defaults(handler=run_push_command)

    pull = subparsers.add_parser("pull", help="download the routing mask (or mask set) of a target/drafter pair")
    pull.add_argument("--target", required=True, help="target model: Hub id or zoo name")
    pull.add_argument("--drafter", default="self", help='drafter model: Hub id, zoo name or "self" (default)')
    pull.add_argument("--repo-id", help=f"Hub repo of masks (default ${MASKS_REPO_ENV} or {DEFAULT_MASKS_REPO})")
    _add_hub_options(pull, revision_help="branch or commit sha to read (default main)")
    pull.add_argument("--out", required=True, type=Path, help=f"folder to write {MASK_FILENAME} (and a set's {MASK_SET_FILENAME} and members) into")
    pull.set_defaults(handler=run_pull_command)


def _add_hub_options(parser: argparse.ArgumentParser, revision_help: str) -> None:
    parser.add_argument("--revision", help=revision_help)
    parser.add_argument("--endpoint", help="Hub URL (default $HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--token", help="Hub token (default: the one saved by `hf auth login`)")


def run_push_command(args: argparse.Namespace) -> int:
    """Check the mask folder before asking the Hub anything, then publish it in one commit."""
    check_repo_id(args.repo_id)
    check_endpoint(args.endpoint)
    source = Path(args.mask_dir).expanduser()
    if not source.exists():  # else RoutingMask.from_pretrained would take it for a Hub id and ask the Hub
        raise UsageError(f"MASK_DIR {args.mask_dir}: no such folder or file")
    try:
        read_pushable(source)
    except MALFORMED_MASK_ERRORS as error:
        raise UsageError(f"MASK_DIR {args.mask_dir}: not a valid routing mask: {first_line(error)}") from None
    try:
        commit = push_mask(source, args.repo_id, token=args.token, endpoint=args.endpoint, revision=args.revision)
    except (RoutingMaskError, HfHubHTTPError) as error:
        raise CommandError(f"{args.repo_id}: {first_line(error)}") from error
    except NO_ANSWER as error:
        raise CommandError(f"the Hub at {args.endpoint or constants.ENDPOINT} did not answer: {first_line(error)}") from error
    print(f"pushed {args.mask_dir} to {args.repo_id}: {commit}")
    return 0


def run_pull_command(args: argparse.Namespace) -> int:
    """Find the pair's mask set or mask (``MaskSet.find_for_pair``), save it to ``--out`` and say where it came from."""
    check_repo_id(args.repo_id)
    check_endpoint(args.endpoint)
    for flag, model in (("--target", args.target), ("--drafter", args.drafter)):
        if not model.strip().strip("/"):
            raise UsageError(f"{flag} must name a model")
    check_output_dir(args.out, "--out")
    try:
        masks, where = MaskSet.find_for_pair(
            args.target, args.drafter, repo_id=args.repo_id, revision=args.revision, endpoint=args.endpoint,
            token=args.token,
        )  # fmt: skip
    except RoutingMaskError as error:  # a headline, then where it looked and how to get a mask
        raise CommandError(str(error) if args.debug else _in_one_line(error)) from None
    except MALFORMED_MASK_ERRORS as error:
        raise CommandError(f"the routing mask found is not valid: {first_line(error)}") from None
    if len(masks.masks) == 1:
        path = masks.default_mask.save_pretrained(args.out)
    else:
        path = masks.save_pretrained(args.out)
    print(f"wrote {path} (from {where}): {_describe(masks)}")
    return 0


def _in_one_line(error: RoutingMaskError) -> str:
    """A not-found message (a headline, every place looked, how to get a mask) as its headline and advice."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    places = [line for line in lines if line.startswith("- ")]
    headline = lines[0].removesuffix("Looked in:").strip().rstrip(".")
    advice = [line for line in lines[1:] if not line.startswith("- ")]
    if len(places) > 2:  # the Hub's answer says most: a missing repo or revision, no connection
        hub = next((place[2:] for place in places if "Hub repo" in place), places[0][2:])
        looked = f" (looked in {len(places)} places, among them {hub}; --debug lists them all)"
    else:
        looked = f" (looked in {'; '.join(place[2:] for place in places)})" if places else ""
    return " ".join([headline + looked + ".", *advice])


def _describe(masks: MaskSet) -> str:
    """What was pulled, one clause per member: layers kept, the default first."""
    kept = [f"{name!r} keeps {len(mask.kept_layers)} of {mask.num_layers} layers" for name, mask in masks.masks.items()]
    target = masks.default_mask.target_id
    if len(kept) == 1:
        return f"keeps {len(masks.default_mask.kept_layers)} of {masks.default_mask.num_layers} layers of {target}"
    return f"a mask set of {len(kept)} masks for {target} (default {masks.default!r}): " + "; ".join(kept)
