"""A stratified calibration corpus: six task families from the shipped evaluation data, split three ways.

A mask searched on one narrow prompt set can fit that set and nothing else, so DIMR
calibrates on a mix of task families, and a mask is judged on prompts that no step of its search
saw. Every family draws from several sources in ``viasd_hf/data`` (strata); each stratum is
shuffled with its own seed (``f"{seed}/{stratum}"``, so adding a source leaves the others' order
alone) and the strata are interleaved round-robin. Each family's order is then cut, in this order,
into ``heldout`` (a fixed :data:`HELDOUT_PER_FAMILY` prompts, used only to judge finished masks),
``validation`` (what a search may select on) and ``calibration`` (what it optimises on). As the
held-out prompts come first, changing the calibration or validation sizes never moves one into
the held-out set.

Families and their strata (sources):

- chat: MT-Bench's first turns (as in Spec-Bench) in writing, roleplay, reasoning, extraction, STEM, humanities;
- translation: WMT14 newstest2014, de→en, en→de and en→fr, each on its own third of the lines;
- summarisation: CNN/DM (Spec-Bench's 80 articles) and XSum;
- qa: Spec-Bench RAG, Spec-Bench QA, NQ-open dev;
- maths: GSM8K test, MT-Bench maths;
- code: HumanEval, MT-Bench coding.

The same text can sit in two shipped files (Spec-Bench's translation lines are WMT14 lines, its
maths questions GSM8K's, its RAG questions NQ-open's, MT-Bench is in Spec-Bench), so every prompt
has a content key (its source text, lower-case letters and digits only) and only the first prompt
with a given key is kept. :func:`content_keys` maps prompt ids, including the bare Spec-Bench
question ids older masks record, to those keys, so overlap with a search's prompts can be checked.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd_hf.calibration.windows import Calibration, Prompt, build_windows
from viasd_hf.data.datasets import (
    cnn_dm_records,
    data_dir,
    gsm8k_records,
    humaneval_records,
    nq_open_records,
    spec_bench_records,
    wmt14_pairs,
    xsum_records,
)
from viasd_hf.data.tasks import (
    cnn_dm_prompt,
    gsm8k_prompt,
    humaneval_prompt,
    nq_prompt,
    translation_prompt,
    xsum_prompt,
)

SPLITS = ("heldout", "validation", "calibration")
HELDOUT_PER_FAMILY = 12
DEFAULT_SIZES = {"validation": 4, "calibration": 8}  # per family, for ``viasd search --corpus stratified``
DEFAULT_DEPTHS = (0, 16, 32, 48)
DEFAULT_SEED = 0

_CHAT = ("writing", "roleplay", "reasoning", "extraction", "stem", "humanities")
_LANGUAGES = {"de-en": ("German", "English"), "en-de": ("English", "German"), "en-fr": ("English", "French")}


@dataclass(frozen=True)
class Entry:
    """A corpus prompt with the stratum it was drawn from and its content key."""

    prompt: Prompt
    stratum: str
    key: str


def normalise(text: str) -> str:
    """Lower-case letters and digits only: the same sentence tokenised or punctuated differently has one key."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _entry(stratum: str, family: str, name: str, text: str, source_text: str) -> Entry:
    return Entry(Prompt(f"{stratum}:{name}", text, family), stratum, normalise(source_text))


# --------------------------------------------------------------------------- sources, one stratum each


def spec_bench_source_text(category: str, text: str) -> str:
    """The part of a Spec-Bench prompt that another shipped file may also hold (its content key's text)."""
    if category == "translation":
        return text.split(": ", 1)[1]
    if category == "summarization":
        return text.removeprefix("Summarize: ")
    if category == "rag":
        return text.strip().splitlines()[-1]  # the question after the retrieved context
    return text


def _spec_bench_entries(family: str, category: str) -> Callable[[], list[Entry]]:
    def load() -> list[Entry]:
        stratum = f"spec_bench-{category}"
        return [
            _entry(stratum, family, str(r["question_id"]), r["turns"][0], spec_bench_source_text(category, r["turns"][0]))
            for r in spec_bench_records()
            if r["category"] == category
        ]

    return load


def _wmt14_entries(direction: str) -> Callable[[], list[Entry]]:
    """One translation direction over every third newstest2014 line, so no sentence is in two directions."""

    def load() -> list[Entry]:
        source_language, target_language = _LANGUAGES[direction]
        index = list(_LANGUAGES).index(direction)
        entries = []
        for line, (de, en) in enumerate(wmt14_pairs()):
            if line % len(_LANGUAGES) == index:
                text = translation_prompt(source_language, target_language, de if direction == "de-en" else en)
                entries.append(_entry(f"wmt14-{direction}", "translation", str(line), text, de))
        return entries

    return load


def _cnn_dm_entries() -> list[Entry]:
    return [_entry("cnn_dm", "summarisation", str(r["question_id"]), cnn_dm_prompt(r), r["article"]) for r in cnn_dm_records()]


def _xsum_entries() -> list[Entry]:
    return [_entry("xsum", "summarisation", r["id"], xsum_prompt(r), r["document"]) for r in xsum_records()]


def _nq_open_entries() -> list[Entry]:
    return [_entry("nq_open", "qa", str(i), nq_prompt(r), r["question"]) for i, r in enumerate(nq_open_records())]


def _gsm8k_entries() -> list[Entry]:
    return [_entry("gsm8k", "maths", str(i), gsm8k_prompt(r), r["question"]) for i, r in enumerate(gsm8k_records())]


def _humaneval_entries() -> list[Entry]:
    return [_entry("humaneval", "code", r["task_id"], humaneval_prompt(r), r["prompt"]) for r in humaneval_records()]


# Family -> its strata, in priority order: of two prompts with one content key, the earlier stays.
FAMILIES: dict[str, tuple[Callable[[], list[Entry]], ...]] = {
    "chat": tuple(_spec_bench_entries("chat", category) for category in _CHAT),
    "translation": tuple(_wmt14_entries(direction) for direction in _LANGUAGES),
    "summarisation": (_cnn_dm_entries, _xsum_entries),
    "qa": (_spec_bench_entries("qa", "rag"), _spec_bench_entries("qa", "qa"), _nq_open_entries),
    "maths": (_gsm8k_entries, _spec_bench_entries("maths", "math")),
    "code": (_humaneval_entries, _spec_bench_entries("code", "coding")),
}


@cache
def _entries(root: Path) -> dict[str, list[Entry]]:
    """Family -> every entry of its strata, in priority order, before deduplication."""
    return {family: [entry for load in sources for entry in load()] for family, sources in FAMILIES.items()}


@cache
def _pool(root: Path) -> dict[str, dict[str, list[Entry]]]:
    """Family -> stratum -> entries, deduplicated by content key across the whole corpus."""
    seen: set[str] = set()
    pool: dict[str, dict[str, list[Entry]]] = {}
    for family, entries in _entries(root).items():
        pool[family] = {}
        for entry in entries:
            if entry.key not in seen:
                seen.add(entry.key)
                pool[family].setdefault(entry.stratum, []).append(entry)
    return pool


def pool() -> dict[str, dict[str, list[Entry]]]:
    """The deduplicated corpus of the current evaluation data (``$VIASD_DATA`` or the packaged copy)."""
    return _pool(data_dir())


# --------------------------------------------------------------------------- the split


@dataclass(frozen=True)
class Corpus:
    """Per split and family, the prompts of the stratified corpus (see the module docstring)."""

    splits: dict[str, dict[str, list[Prompt]]]
    seed: int

    @property
    def families(self) -> list[str]:
        return list(FAMILIES)

    def prompts(self, split: str, families: Iterable[str] | None = None) -> list[Prompt]:
        """The prompts of ``split``, family after family (or only ``families``)."""
        return [p for family in families or self.families for p in self.splits[split][family]]

    def describe(self) -> str:
        sizes = ", ".join(f"{split} {len(self.prompts(split))}" for split in SPLITS)
        return f"stratified corpus (seed {self.seed}; {', '.join(self.families)}; {sizes} prompts)"


def family_order(family: str, seed: int) -> list[Entry]:
    """A family's entries, each stratum shuffled with its own seed, strata interleaved round-robin."""
    strata = []
    for stratum, entries in pool()[family].items():
        shuffled = list(entries)
        random.Random(f"{seed}/{stratum}").shuffle(shuffled)
        strata.append(shuffled)
    return [group[i] for i in range(max(map(len, strata))) for group in strata if i < len(group)]


def stratified_corpus(
    validation: int = DEFAULT_SIZES["validation"],
    calibration: int = DEFAULT_SIZES["calibration"],
    seed: int = DEFAULT_SEED,
    heldout: int = HELDOUT_PER_FAMILY,
) -> Corpus:
    """Held-out, validation and calibration prompts per family (sizes per family), disjoint by content."""
    sizes = {"heldout": heldout, "validation": validation, "calibration": calibration}
    splits: dict[str, dict[str, list[Prompt]]] = {split: {} for split in SPLITS}
    for family in FAMILIES:
        order = family_order(family, seed)
        if sum(sizes.values()) > len(order):
            raise ValueError(f"family {family} has {len(order)} prompts, fewer than the {sum(sizes.values())} asked for")
        taken = 0
        for split in SPLITS:
            splits[split][family] = [entry.prompt for entry in order[taken : taken + sizes[split]]]
            taken += sizes[split]
    return Corpus(splits, seed)


@cache
def _known_keys(root: Path) -> dict[str, str]:
    known = {entry.prompt.id: entry.key for entries in _entries(root).values() for entry in entries}
    return known | {
        str(r["question_id"]): normalise(spec_bench_source_text(r["category"], r["turns"][0]))
        for r in spec_bench_records()
    }


def content_keys(ids: Iterable[str]) -> dict[str, str]:
    """Prompt id -> content key, for corpus ids (``stratum:name``) and bare Spec-Bench question ids.

    Older masks record bare Spec-Bench ids (e.g. ``"501"``); each is read as that question, whatever
    stratum of the corpus (if any) holds its text. An unknown id is an error, so an overlap check
    never passes by not recognising what it was given.
    """
    known = _known_keys(data_dir())
    ids = list(ids)
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise KeyError(f"prompt ids neither in the corpus nor Spec-Bench question ids: {unknown[:5]}")
    return {i: known[i] for i in ids}


def corpus_calibration(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    corpus: Corpus,
    window: int = 16,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    max_prompt_tokens: int = 384,
    progress: bool = True,
) -> Calibration:
    """The search's windows: the corpus's calibration split, with its validation split as the search's held-out set.

    The corpus's own held-out split is left out on purpose: it stays unseen by the search, for
    ``dimr.heldout`` to judge the result on.
    """
    build = dict(window=window, max_prompt_tokens=max_prompt_tokens, progress=progress, depths=depths)
    return Calibration(
        windows=build_windows(model, tokenizer, corpus.prompts("calibration"), **build),
        heldout=build_windows(model, tokenizer, corpus.prompts("validation"), **build),
        source=f"the {corpus.describe()}, calibration split; held out here: its validation split",
        window=window,
        max_prompt_tokens=max_prompt_tokens,
        depths=tuple(sorted(set(depths))),
        families={p.id: family for split in ("calibration", "validation") for family, prompts in corpus.splits[split].items()
                  for p in prompts},  # fmt: skip
    )
