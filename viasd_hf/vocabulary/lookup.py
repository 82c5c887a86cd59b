"""Which draft vocabulary a ``generate`` call uses, looked up once per model and not on every call.

``ViaSDConfig.vocabulary`` is ``"auto"`` (the pair's vocabulary when one is published or shipped,
else none), ``None`` (off), a ``DraftVocabulary``, or a local path / Hub repo id. ``"auto"`` finds
nothing for most models, so unlike routing masks a miss is remembered too: a model without a
vocabulary must not ask the Hub on every call. ``clear_vocabulary_cache`` forgets both.
"""

from __future__ import annotations

import os

from torch import nn

from viasd_hf.masks.architectures import is_encoder_decoder, model_config
from viasd_hf.masks.per_model_cache import PerModelCache
from viasd_hf.masks.repo import default_masks_repo
from viasd_hf.vocabulary.head import SubsetHead
from viasd_hf.vocabulary.store import DraftVocabulary, DraftVocabularyError

AUTO = "auto"

_found: PerModelCache[DraftVocabulary | None] = PerModelCache()


def resolve_vocabulary(spec: DraftVocabulary | str | os.PathLike | None, model: nn.Module, drafter_id: str) -> DraftVocabulary | None:
    """The validated vocabulary ``spec`` names for ``model`` (the target), or ``None`` when decoding the whole vocabulary.

    ``"auto"`` never fails: a pair without a vocabulary, or with one that does not fit the model,
    decodes over the whole vocabulary. An explicit path or repo id that cannot be read raises.
    """
    if spec is None:
        return None
    if isinstance(spec, DraftVocabulary):
        spec.validate_for(model)
        return spec
    if spec == AUTO:
        if is_encoder_decoder(model):
            return None
        pair = (str(model_config(model)._name_or_path), drafter_id)
        vocabulary = _found.get(model, ("pair", *pair, default_masks_repo()), lambda: _fitting(pair, model))
    else:
        vocabulary = _found.get(model, ("spec", os.fspath(spec)), lambda: DraftVocabulary.from_pretrained(spec))
    if vocabulary is not None:
        vocabulary.validate_for(model)
    return vocabulary


def _fitting(pair: tuple[str, str], model: nn.Module) -> DraftVocabulary | None:
    """The pair's vocabulary if there is one made for this model, else ``None``."""
    try:
        vocabulary = DraftVocabulary.find_for_pair(*pair)[0]
        vocabulary.validate_for(model)
    except DraftVocabularyError:
        return None
    return vocabulary


def clear_vocabulary_cache(model: nn.Module | None = None) -> None:
    """Forget the vocabularies (and misses) resolved for ``model`` (every model when ``None``)."""
    _found.clear(model)


def drafter_vocabulary(
    spec: DraftVocabulary | str | os.PathLike | None, target: nn.Module, drafter: nn.Module | None, drafter_id: str,
    copies: bool,
) -> SubsetHead | None:
    """The drafting model's LM head cut to the vocabulary ``spec`` names (``resolve_vocabulary``), or ``None`` without
    a vocabulary. The drafting model is the assistant ``drafter``; without one, none where prompt lookup ``copies``,
    else the target (the self-drafter). The slim tier and the full model always score the whole vocabulary."""
    vocabulary = resolve_vocabulary(spec, target, drafter_id)
    drafting_model = drafter if drafter is not None else (None if copies else target)
    if vocabulary is None or drafting_model is None:
        return None
    vocabulary.validate_rows(drafting_model)
    return SubsetHead(drafting_model, vocabulary.token_ids)
