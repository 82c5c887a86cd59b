"""Routing masks: which decoder layers the slim verifier keeps, and for which model pair.

A mask is only meaningful for the model it was searched on, so it carries that model's
identity (id, revision, config fingerprint, layer count) and refuses to be applied to any
other. It also records how it was found, so a mask pulled from the Hub explains itself.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from . import __version__
from .architectures import config_fingerprint, model_config, num_decoder_layers, protected_layers
from .checks import is_int, is_real

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

MASK_FILENAME = "routing_mask.json"
SCHEMA_VERSION = 1


class RoutingMaskError(ValueError):
    """A routing mask that is malformed or does not belong to the model it is applied to."""


def _wrong_type(name: str, expected: str, value: Any) -> RoutingMaskError:
    return RoutingMaskError(f"routing mask field {name!r} must be {expected}, got {value!r} ({type(value).__name__})")


# Field types as a mask file must spell them (JSON has no int/bool/float coercion worth trusting).
_STR_FIELDS = ("target_id", "target_fingerprint", "drafter_id", "library_version")
_OPTIONAL_STR_FIELDS = ("target_revision", "objective", "calibration")
_REAL_FIELDS = ("alpha1", "alpha2")
_OPTIONAL_REAL_FIELDS = ("objective_value", "skip_ratio", "search_time_s")


@dataclass
class RoutingMask:
    """The layers a slim verifier keeps, the model pair it belongs to, and how it was found."""

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
            raise _wrong_type("kept_layers", "a list of layer indices (ints)", self.kept_layers)
        for layer in self.kept_layers:
            if not is_int(layer):
                raise RoutingMaskError(
                    f"routing mask field 'kept_layers' must hold layer indices (ints), got {layer!r} "
                    f"({type(layer).__name__}) in {list(self.kept_layers)!r}"
                )
        for name in ("num_layers", "schema_version"):
            if not is_int(getattr(self, name)):
                raise _wrong_type(name, "an int", getattr(self, name))
        if self.num_layers < 1:
            raise RoutingMaskError(f"routing mask field 'num_layers' must be >= 1, got {self.num_layers}")
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise _wrong_type(name, "a string", getattr(self, name))
        for name in _OPTIONAL_STR_FIELDS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise _wrong_type(name, "a string or null", getattr(self, name))
        for name in _REAL_FIELDS:
            if not is_real(getattr(self, name)):
                raise _wrong_type(name, "a number", getattr(self, name))
        for name in _OPTIONAL_REAL_FIELDS:
            if getattr(self, name) is not None and not is_real(getattr(self, name)):
                raise _wrong_type(name, "a number or null", getattr(self, name))
        if not isinstance(self.metadata, dict):
            raise _wrong_type("metadata", "a JSON object (dict)", self.metadata)

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

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Write ``routing_mask.json`` into ``save_directory`` and return its path."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MASK_FILENAME
        path.write_text(self.to_json())
        return path

    def push_to_hub(self, repo_id: str, **options: Any) -> CommitInfo:
        """Publish this mask to a Hub repo of masks and refresh the repo's model card.

        It lands at ``<target-slug>/<drafter-slug or self>/routing_mask.json`` (slugs default to
        the ids in the mask). A mask that is inconsistent, or not made for ``model=`` when one is
        given, is refused. Returns the commit (a ``str``, its URL; ``.oid`` is the commit sha).
        ``options`` are those of ``viasd_hf.hub.push_mask`` (``endpoint``, ``revision``, ``token``, ...).
        """
        from .hub import push_mask

        return push_mask(self, repo_id, **options)

    @classmethod
    def from_pretrained(
        cls,
        source: str | Path | tuple[str, str],
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
        or, for a pair, the masks repo ``repo_id`` (default ``$VIASD_MASKS_REPO``) at
        ``<target-slug>/<drafter-slug or self>/routing_mask.json``, then the masks shipped with
        viasd_hf. See ``viasd_hf.hub.pull_mask``.
        """
        if isinstance(source, Path) or (isinstance(source, str) and Path(source).exists()):
            return cls._from_local(Path(source, subfolder or ""))
        from .hub import pull_mask

        return pull_mask(
            source, subfolder=subfolder, revision=revision, repo_id=repo_id, endpoint=endpoint, token=token,
            local_files_only=local_files_only, cache_dir=cache_dir,
        )

    @classmethod
    def _from_local(cls, path: Path) -> RoutingMask:
        file = path / MASK_FILENAME if path.is_dir() else path
        if not file.is_file():
            raise RoutingMaskError(f"no routing mask at {path} (expected a folder with {MASK_FILENAME} or that file)")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise RoutingMaskError(f"{file} is not a routing mask: it is not UTF-8 text ({error})") from error
        except json.JSONDecodeError as error:
            raise RoutingMaskError(f"{file} is not valid JSON: {error}") from error
        return cls.from_dict(data)
