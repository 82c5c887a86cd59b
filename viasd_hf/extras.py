"""The optional packages, imported only where a feature needs them, and what libraries print on their own, held back.

``pip install viasd_hf`` brings what ``generate`` needs: torch, transformers, huggingface-hub, safetensors and tqdm.
Each extra brings the packages of one group of features (pyproject.toml): ``quant`` quantised tiers and drafting
copies (bitsandbytes, torchao, accelerate), ``search`` DIMR's mask search (scikit-optimize), ``bench`` the scores,
memory and plots of ``viasd bench`` (rouge-score, sacrebleu, psutil, matplotlib), ``zoo`` the built-in models (gguf,
accelerate); ``all`` every one. :func:`require` imports a package where a feature needs it, or says which extra
installs it.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# the distribution that installs a module, where its name is not the module's
_DISTRIBUTIONS = {"skopt": "scikit-optimize", "rouge_score": "rouge-score"}
# libraries that log on their own while they are imported, or while a model is converted and timed: torchao its
# kernel libraries that do not load (and, through torch's pytree, its deprecated registrations), bitsandbytes its
# casts and the Hub kernel it could not fetch, the kernels Hub client its trust checks
_CHATTY_LOGGERS = ("bitsandbytes", "kernels", "torchao", "torch.utils._pytree")
# what transformers' assisted generation logs, once a process, about its own call (its candidate generator hands the
# assistant's generate a generation config and generation arguments both): nothing its caller can change
_THEIR_OWN_DEPRECATION = "Passing `generation_config` together with generation-related arguments"


class MissingExtraError(ImportError):
    """An optional package a feature needs is not installed; the message names the extra that installs it."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``module``, imported :func:`quietly`; where its package is missing, :class:`MissingExtraError` naming the
    extra of ``pip install viasd_hf[...]`` that installs it (``feature``: what needs it, for the message)."""
    try:
        with quietly():
            return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.partition(".")[0]
        package = _DISTRIBUTIONS.get(top, top)
        raise MissingExtraError(
            f"{feature} needs the optional package {package}: pip install 'viasd_hf[{extra}]'"
        ) from error


@contextmanager
def quietly() -> Iterator[None]:
    """Hold back what libraries print on their own while inside: transformers' progress bars and notices, the logs of
    the libraries above and Python's warnings. Around imports of optional packages and work done once for the user
    (a drafter's copies saved, loaded and timed), never around a user's own calls. Warnings go unshown rather than
    filtered: the filters a library adds as it is imported must outlive the block."""
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    verbosity = transformers_logging.get_verbosity()
    levels = {name: logging.getLogger(name).level for name in _CHATTY_LOGGERS}
    shown = warnings.showwarning
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.showwarning = _unshown
    try:
        yield
    finally:
        warnings.showwarning = shown
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def _unshown(*args: object, **kwargs: object) -> None:
    """``warnings.showwarning`` inside :func:`quietly`."""


class _DropTheirOwnDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_THEIR_OWN_DEPRECATION)


def hide_assisted_generation_deprecation() -> None:
    """From now on, drop the deprecation transformers' assisted generation logs about its own call of the
    assistant's ``generate`` (for ``viasd`` commands, which run HF assisted generation as a baseline)."""
    log = logging.getLogger("transformers.generation.utils")
    if not any(isinstance(f, _DropTheirOwnDeprecation) for f in log.filters):
        log.addFilter(_DropTheirOwnDeprecation())
