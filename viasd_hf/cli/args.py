"""Checks of ``viasd`` arguments, run before any model is loaded.

Loading a model takes minutes, so a typo in a model name, a file, a dtype or a number must be
reported before that, as one line (``viasd <command>: error: ...``) and a non-zero exit status,
never as a traceback. Numbers are checked by the argparse ``type=`` functions below (argparse
prints its usage and exits with status 2); everything else raises :class:`UsageError` (status 2)
or :class:`CommandError` (status 1, for failures that are not the command line's fault), which
``viasd_hf.cli.main`` prints.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig

from viasd_hf.masks.routing_mask import MALFORMED_MASK_ERRORS, RoutingMask, RoutingMaskError
from viasd_hf.models import loading as models
from viasd_hf.models import zoo
from viasd_hf.models.quantization import QuantizationUnavailableError, scheme_names

# The dtypes ``viasd_hf.models.loading.load_pretrained`` accepts by name (tests/test_cli.py keeps them in step).
DTYPES = ("float32", "bfloat16", "float16", "auto")


class CommandError(Exception):
    """A failure to report as one line and exit status 1 (a model that cannot be loaded, an unreachable Hub)."""

    exit_status = 1


class UsageError(CommandError):
    """A mistake in the command line: one line and exit status 2, as argparse does."""

    exit_status = 2


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message (Hub and transformers errors run to several)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


# --------------------------------------------------------------------------- argparse types


def _number(parse: Callable[[str], float], kind: str, check: Callable[[float], bool], wanted: str):
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text}")
        return value

    convert.__name__ = kind
    return convert


LARGEST_COUNT = 2**31 - 1  # a count beyond this is a typo, and would overflow a tensor's size or an index


def _whole(minimum: int, kind: str):
    """A whole number from ``minimum`` to ``LARGEST_COUNT``."""
    at_least = _number(int, kind, lambda v: v >= minimum, f"a whole number >= {minimum}")

    def convert(text: str) -> int:
        value = at_least(text)
        if value > LARGEST_COUNT:
            raise argparse.ArgumentTypeError(f"expected a whole number <= {LARGEST_COUNT}, got {text}")
        return value

    convert.__name__ = kind
    return convert


positive_int = _whole(1, "positive_int")
non_negative_int = _whole(0, "non_negative_int")
positive_float = _number(float, "positive_float", lambda v: v > 0 and v != float("inf"), "a number > 0")
non_negative_float = _number(float, "non_negative_float", lambda v: 0 <= v < float("inf"), "a number >= 0")
probability = _number(float, "probability", lambda v: 0 <= v <= 1, "a number from 0 to 1")


def tokens_or_none(text: str) -> int | None:
    """A token count >= 1, or ``none`` for no limit."""
    return None if text.strip().lower() == "none" else positive_int(text)


def _listed(convert: Callable[[str], float], wanted: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not text.strip() or any(not part for part in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {wanted}, got {text!r}")
        try:
            return [convert(part) for part in parts]
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{error} (in {text!r})") from None

    return parse


skip_fraction = _number(float, "skip_fraction", lambda v: 0 < v < 1, "a fraction of layers between 0 and 1")
skip_fractions = _listed(skip_fraction, "fractions between 0 and 1")
positive_ints = _listed(positive_int, "whole numbers >= 1")
non_negative_ints = _listed(non_negative_int, "whole numbers >= 0")
QUANTIZED_ROLES = ("drafter", "target")


def quantize_spec(text: str) -> dict[str, str]:
    """``drafter=SCHEME,target=SCHEME`` (either may be left out) as ``{role: scheme}``."""
    spec: dict[str, str] = {}
    for part in text.split(","):
        role, _, scheme = (piece.strip() for piece in part.partition("="))
        if role not in QUANTIZED_ROLES or not scheme:
            raise argparse.ArgumentTypeError(f"expected drafter=SCHEME,target=SCHEME, got {text!r}")
        if scheme not in scheme_names():
            raise argparse.ArgumentTypeError(f"unknown scheme {scheme!r} for the {role}; choose from {', '.join(scheme_names())}")
        if role in spec:
            raise argparse.ArgumentTypeError(f"the {role} is named twice in {text!r}")
        spec[role] = scheme
    return spec


# --------------------------------------------------------------------------- models, files, the Hub


def check_model(name: str, flag: str) -> None:
    """A zoo name, a local model folder or a Hub id (cached, when offline); else ``UsageError``."""
    if name in zoo.ZOO:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{flag} {name}: the folder has no config.json, so it holds no model")
        return
    if path.exists():
        raise UsageError(f"{flag} {name}: is a file; pass a zoo name, a model folder or a Hub id")
    known = ", ".join(zoo.ZOO)
    close = difflib.get_close_matches(name.lower(), list(zoo.ZOO), n=1, cutoff=0.75)
    if close and "/" not in name:
        raise UsageError(f"{flag} {name}: unknown model; did you mean the zoo model {close[0]}? (zoo: {known})")
    if name.startswith((".", "/", "~")):
        raise UsageError(f"{flag} {name}: no such folder")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UsageError(f"{flag} {name}: not a zoo name ({known}), a model folder or a Hub id") from None
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise UsageError(
            f"{flag} {name}: not a zoo name ({known}) or a model folder, and not in the Hugging Face cache "
            "(HF_HUB_OFFLINE is set, so the Hub is not asked)"
        )


def check_input_file(path: str, flag: str) -> Path:
    file = Path(path).expanduser()
    if not file.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not file.is_file():
        raise UsageError(f"{flag} {path}: not a file")
    if not os.access(file, os.R_OK):
        raise UsageError(f"{flag} {path}: not readable")
    return file


def check_output_file(path: str, flag: str) -> None:
    """A file that can be written (its folder may not exist yet), checked before the work that fills it."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    _check_creatable(file.parent, flag, path)


def check_output_dir(path: str, flag: str) -> None:
    """A folder that exists or can be made, and written into."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a folder")
    _check_creatable(folder, flag, path)


def _check_creatable(folder: Path, flag: str, shown: str) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {shown}: {existing} is a file, so no folder can be made there")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {shown}: {existing} is not writable")


def check_endpoint(url: str | None, flag: str = "--endpoint") -> None:
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"{flag} {url}: not an http(s) URL, e.g. https://huggingface.co")


def check_repo_id(repo_id: str | None, flag: str = "--repo-id") -> None:
    if repo_id is None:
        return
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UsageError(f"{flag} {repo_id}: not a Hub repo id ({first_line(error)})") from None


def load_model(name: str, dtype: str, flag: str, quantization: str | None = None):
    """``load_pretrained``, with a model that cannot be loaded reported as one line.

    A quantised model keeps its scheme's own dtype (the activations its kernels take), not ``dtype``.
    """
    try:
        if quantization is not None:
            return models.load_pretrained(name, quantization=quantization)
        return models.load_pretrained(name, dtype=dtype)
    except QuantizationUnavailableError as error:
        raise CommandError(f"{flag} {name}: {first_line(error)}") from error
    except (OSError, ValueError, zoo.ZooError) as error:
        raise CommandError(f"{flag} {name}: could not load the model: {first_line(error)}") from error


# --------------------------------------------------------------------------- routing masks

_OWN_MASK = "pass a mask searched for the target (`viasd search` or `viasd pull`)"


def known_mask(target_name: str, drafters: tuple[str, ...]) -> RoutingMask | None:
    """The first mask found offline (user cache, then ``hub_masks/``) for the target with one of ``drafters``."""
    for drafter in drafters:
        try:
            return RoutingMask.from_pretrained((target_name, drafter), local_files_only=True)
        except RoutingMaskError:
            continue
    return None


def mask_from(flag: str, source: str, target: str) -> RoutingMask:
    try:
        mask = RoutingMask.from_pretrained(source)
    except RoutingMaskError as error:  # not found (with where it looked) or malformed
        raise UsageError(f"{flag} {source}: {error}") from None
    except MALFORMED_MASK_ERRORS as error:
        raise UsageError(f"{flag} {source}: not a valid routing mask: {first_line(error)}") from None
    _check_mask_target(f"{flag} {source}", mask, target)
    return mask


def _check_mask_target(flag: str, mask: RoutingMask, target: str) -> None:
    """Refuse a mask made for another model before the models load (minutes): for a zoo target, by name (zoo
    models keep theirs as their id), else by the depth its config.json gives, when that is on disk. The full
    check (config fingerprint, protected layers) runs once the target is loaded."""
    if target in zoo.ZOO:
        if mask.target_id in zoo.ZOO and mask.target_id != target:
            raise UsageError(f"{flag}: this routing mask is for {mask.target_id}, not --target {target}; {_OWN_MASK}")
        return
    try:
        layers = AutoConfig.from_pretrained(target, local_files_only=True).get_text_config().num_hidden_layers
    except (OSError, ValueError):
        return  # only loading the target can tell
    if layers != mask.num_layers:
        raise UsageError(
            f"{flag}: this routing mask is for a {mask.num_layers}-layer model ({mask.target_id}), but --target "
            f"{target} has {layers} decoder layers; {_OWN_MASK}"
        )
