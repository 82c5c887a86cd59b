"""``DraftVocabulary``: the tokens the cheap tiers (drafter, slim verifier) may propose, and what it was built on.

The idea of FR-Spec applied to both cheap tiers: most of what a model writes falls within a
small, frequency-ranked part of its vocabulary, so the drafter and the slim verifier compute
only those rows of the LM head. A vocabulary is only meaningful for the tokenizer and target it
was counted on, so it carries the target's identity (id, config fingerprint, LM-head rows, the
tokenizer's length) and refuses any other model. It lives beside the routing mask of its pair
(``viasd_hf.masks.repo`` layout), in the masks repo and in ``hub_masks/``::

    <target-slug>/<drafter folder>/draft_vocabulary.json
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from huggingface_hub import HfApi
from torch import nn

from viasd_hf.hub.files import Lookup, NotFoundError
from viasd_hf.hub.mixin import HubMixin
from viasd_hf.masks.architectures import base_model, config_fingerprint, model_config
from viasd_hf.masks.repo import find_pair_file, pair_folder
from viasd_hf.validation import INT, JSON_OBJECT, STR, FieldType, check_fields, is_int, is_real
from viasd_hf.version import __version__

VOCABULARY_FILENAME = "draft_vocabulary.json"
SCHEMA_VERSION = 1
HOW_TO_GET_A_VOCABULARY = (
    "To get one: build it for the target with `viasd vocab --target TARGET [--drafter DRAFTER] --out DIR`, "
    "or pass ViaSDConfig(vocabulary=None) to decode over the whole vocabulary."
)


class DraftVocabularyError(ValueError):
    """A draft vocabulary that is malformed, missing, or not made for the model it is used with."""


# Field types as a vocabulary file must spell them.
_FIELD_TYPES = (
    (
        ("token_ids",),
        FieldType(
            lambda ids: isinstance(ids, (list, tuple)) and all(is_int(token) for token in ids), "a list of token ids (ints)"
        ),
    ),
    (("vocab_size", "schema_version"), FieldType(lambda count: is_int(count) and count >= 1, "an int >= 1")),
    (("tokenizer_size",), INT.or_none("null")),
    (("target_id", "target_fingerprint", "drafter_id", "library_version"), STR),
    (("target_revision", "cost_model_id", "counted"), STR.or_none("null")),
    (
        ("coverage", "head_cost"),
        FieldType(
            lambda table: isinstance(table, dict) and all(isinstance(k, str) and is_real(v) for k, v in table.items()),
            "a JSON object of size (string) -> number",
        ),
    ),
    (("metadata",), JSON_OBJECT),
)


def lm_head_rows(model: nn.Module) -> int:
    """The number of rows of ``model``'s LM head: the width of every logits row."""
    return int(base_model(model).get_output_embeddings().weight.shape[0])


@dataclass
class DraftVocabulary(HubMixin):
    """The token ids the cheap tiers may propose, most frequent first, and the target they were counted on.

    ``coverage`` and ``head_cost`` map candidate sizes (as strings, JSON keys) to the fraction of
    held-out target tokens inside the first that many ids, and to the cost of one forward pass of
    ``cost_model_id`` with that many LM-head rows relative to the full head; the size chosen is
    ``len(token_ids)`` (see ``viasd_hf.calibration.vocabulary``).
    """

    hub_filename = VOCABULARY_FILENAME
    hub_kind = "draft vocabulary"
    hub_advice = HOW_TO_GET_A_VOCABULARY
    not_found_error = DraftVocabularyError
    malformed_error = DraftVocabularyError

    token_ids: list[int]
    vocab_size: int  # rows of the target's LM head the ids index
    target_id: str
    target_fingerprint: str
    tokenizer_size: int | None = None  # len(tokenizer) when counted
    target_revision: str | None = None
    drafter_id: str = "self"
    coverage: dict[str, float] = field(default_factory=dict)
    head_cost: dict[str, float] = field(default_factory=dict)
    cost_model_id: str | None = None
    counted: str | None = None  # what the frequencies were counted on
    library_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, _FIELD_TYPES, "draft vocabulary field {!r}", DraftVocabularyError)
        self.token_ids = [int(token) for token in self.token_ids]
        if not self.token_ids:
            raise DraftVocabularyError("a draft vocabulary must hold at least one token id")
        if len(set(self.token_ids)) != len(self.token_ids):
            raise DraftVocabularyError("draft vocabulary field 'token_ids' has duplicates")
        outside = [token for token in self.token_ids if not 0 <= token < self.vocab_size]
        if outside:
            raise DraftVocabularyError(
                f"token ids {outside[:5]} lie outside 0..{self.vocab_size - 1} (the LM head's rows, vocab_size)"
            )
        if self.schema_version > SCHEMA_VERSION:
            raise DraftVocabularyError(
                f"draft vocabulary schema {self.schema_version} is newer than this viasd_hf understands "
                f"({SCHEMA_VERSION}); upgrade viasd_hf"
            )

    @property
    def size(self) -> int:
        """V: how many tokens the cheap tiers may propose."""
        return len(self.token_ids)

    @property
    def pair_folder(self) -> str:
        """Its folder in a masks repo, beside the routing mask of its pair."""
        return pair_folder(self.target_id, self.drafter_id)

    def validate_for(self, model: nn.Module, tokenizer: Any = None) -> None:
        """Raise ``DraftVocabularyError`` unless this vocabulary was counted for ``model`` (and ``tokenizer``)."""
        fix = "build one for this model with `viasd vocab`, or pass ViaSDConfig(vocabulary=None)"
        name = getattr(model_config(model), "_name_or_path", "?")
        fingerprint = config_fingerprint(model)
        if fingerprint != self.target_fingerprint:
            raise DraftVocabularyError(
                f"this draft vocabulary is for {self.target_id} (config fingerprint {self.target_fingerprint}), but "
                f"the model's config fingerprint is {fingerprint} ({name}); {fix}"
            )
        self.validate_rows(model)
        if tokenizer is not None and self.tokenizer_size is not None and len(tokenizer) != self.tokenizer_size:
            raise DraftVocabularyError(
                f"this draft vocabulary was counted with a tokenizer of {self.tokenizer_size} tokens, but the "
                f"tokenizer has {len(tokenizer)}; {fix}"
            )

    def validate_rows(self, model: nn.Module) -> None:
        """Raise unless ``model``'s LM head has the rows the ids index (a drafter sharing the target's tokenizer)."""
        rows = lm_head_rows(model)
        if rows != self.vocab_size:
            raise DraftVocabularyError(
                f"this draft vocabulary indexes an LM head of {self.vocab_size} rows ({self.target_id}), but "
                f"{getattr(model_config(model), '_name_or_path', '?')} has {rows}; use a vocabulary built for "
                "this tokenizer (`viasd vocab`), or ViaSDConfig(vocabulary=None)"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """The ``draft_vocabulary.json`` text: the ids on one line, the rest one field a line, keys sorted."""
        data = self.to_dict()
        ids = json.dumps(data.pop("token_ids"), separators=(",", ":"))
        body = json.dumps(data, indent=2, sort_keys=True)
        return body[:-2] + f',\n  "token_ids": {ids}\n}}\n'

    @classmethod
    def from_dict(cls, data: Any) -> DraftVocabulary:
        if not isinstance(data, dict):
            raise DraftVocabularyError(f"a draft vocabulary must be a JSON object of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise DraftVocabularyError(f"unknown draft vocabulary fields {unknown}; is it from a newer viasd_hf?")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise DraftVocabularyError(f"the draft vocabulary lacks required fields {missing}")
        return cls(**data)

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
    ) -> tuple[DraftVocabulary, str]:
        """The vocabulary of the ``(target, drafter)`` pair and where it was found.

        Looked for in the pair's folder, then in the target's ``model-free`` folder (a vocabulary is
        the target's: any drafter sharing its tokenizer can use it); in the masks repo ``repo_id``
        (default ``$VIASD_MASKS_REPO``), then, unless ``repo_id`` or ``revision`` was given, in the
        folders shipped with viasd_hf. Raises ``DraftVocabularyError`` naming every place it looked.
        """
        api = HfApi(endpoint=endpoint, token=token)
        lookup = Lookup(revision=revision, local_files_only=local_files_only, cache_dir=None)
        try:
            found = find_pair_file(api, target, drafter, repo_id, lookup, (VOCABULARY_FILENAME,), fallback_drafters=("self",),
                                   what="draft vocabulary", how_to=HOW_TO_GET_A_VOCABULARY)
        except NotFoundError as error:
            raise DraftVocabularyError(str(error)) from error
        return cls._read(found.path), found.where

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike[str] | tuple[str, str], **options: Any) -> DraftVocabulary:
        """A local folder or file, a Hub repo id (``subfolder``, ``revision``, ...), or a ``(target, drafter)`` pair."""
        if isinstance(source, tuple):
            return cls.find_for_pair(*source, **options)[0]
        return super().from_pretrained(source, **options)
