"""Evaluation examples from the datasets shipped in ``viasd_hf/data`` (see its README), read by ``datasets``.

Every loader returns the same :class:`Example` shape, so the bench can run any decoding method
over any dataset and score it with :func:`viasd_hf.bench.quality.quality`. ``limit`` always takes
the first N records of each task: deterministic, and the order the upstream files use.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from viasd_hf.data.datasets import (
    cnn_dm_records,
    gsm8k_records,
    humaneval_records,
    mt_bench_records,
    nq_open_records,
    spec_bench_qa_answers,
    spec_bench_records,
    wmt14_pairs,
    xsum_records,
)


@dataclass(frozen=True)
class Example:
    """One prompt to generate for, with what a good answer looks like."""

    task: str
    prompt: str  # the user message; the caller applies the chat template
    reference: str | list[str] | None = None  # one reference, or several acceptable answers
    extra: dict = field(default_factory=dict)  # task-specific, e.g. the HumanEval test program


DATASETS: tuple[str, ...] = ("spec_bench", "humaneval", "gsm8k", "xsum", "wmt14", "cnn_dm", "nq", "mt_bench")

# Quality metrics computed per task by ``quality.quality``. Tasks not listed (custom prompts) get
# none: use ``TASK_METRICS.get(task, ())``; greedy agreement is computed elsewhere for all tasks.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "summarization": ("rougeL",),
    "cnn_dm": ("rougeL",),
    "xsum": ("rougeL",),
    "translation": ("bleu", "chrf"),
    "wmt14": ("bleu", "chrf"),
    "math_reasoning": ("exact_match",),
    "gsm8k": ("exact_match",),
    "qa": ("exact_match",),
    "nq": ("exact_match",),
    "rag": ("exact_match",),
    "humaneval": ("pass@1",),
    "mt_bench": (),
    "custom": (),
}

SPEC_BENCH_TASKS: tuple[str, ...] = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a single ```python code block."
)
GSM8K_INSTRUCTION = "Solve step by step and end with a line of the form '#### <number>'."


def _first_reference(record: dict[str, Any]) -> Any:
    refs = record.get("reference")
    return refs[0] if refs else None


def _first_turn(task: str, record: dict[str, Any], reference: Any) -> Example:
    return Example(
        task=task,
        prompt=record["turns"][0],
        reference=reference,
        extra={"question_id": record["question_id"], "category": record["category"]},
    )


def humaneval_prompt(record: dict[str, Any]) -> str:
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{record['prompt']}```"


def gsm8k_prompt(record: dict[str, Any]) -> str:
    return f"{record['question']}\n{GSM8K_INSTRUCTION}"


def xsum_prompt(record: dict[str, Any]) -> str:
    return "Summarize the following article in one sentence.\n\n" + record["document"]


def cnn_dm_prompt(record: dict[str, Any]) -> str:
    return "Summarize: " + record["article"]


def nq_prompt(record: dict[str, Any]) -> str:
    # NQ-open questions are lower-case search queries without a question mark.
    question = record["question"]
    return question[:1].upper() + question[1:] + "?\nAnswer with a short phrase."


def translation_prompt(source_language: str, target_language: str, text: str) -> str:
    return f"Translate {source_language} to {target_language}: {text.strip()}"


def _spec_bench(limit: int | None) -> list[Example]:
    answers = spec_bench_qa_answers()
    by_task: dict[str, list[Example]] = {task: [] for task in SPEC_BENCH_TASKS}
    for record in spec_bench_records():
        category = record["category"]
        if category in _MT_BENCH_CATEGORIES:
            task, reference = "mt_bench", _first_reference(record)
        elif category == "qa":
            # Spec-Bench ships no qa answers; 43 of its 80 questions are NQ-open dev questions.
            task, reference = "qa", answers.get(record["question_id"])
        else:
            task, reference = category, record["reference"][0]
        by_task[task].append(_first_turn(task, record, reference))
    return [example for task in SPEC_BENCH_TASKS for example in by_task[task][:limit]]


def _humaneval(records: Iterable[dict[str, Any]]) -> Iterator[Example]:
    for r in records:
        yield Example(
            task="humaneval",
            prompt=humaneval_prompt(r),
            extra={
                "task_id": r["task_id"],
                "code_prompt": r["prompt"],
                "test": r["test"],
                "entry_point": r["entry_point"],
            },
        )


def _wmt14(limit: int | None) -> list[Example]:
    return [
        Example(task="wmt14", prompt=translation_prompt("German", "English", src), reference=ref.strip())
        for src, ref in islice(wmt14_pairs(), limit)
    ]


def load_examples(dataset: str, limit: int | None = None) -> list[Example]:
    """The examples of one of :data:`DATASETS`; ``limit`` is the number taken from each task."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")

    def head(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return islice(records, limit)

    if dataset == "spec_bench":
        return _spec_bench(limit)
    if dataset == "humaneval":
        return list(_humaneval(head(humaneval_records())))
    if dataset == "gsm8k":
        return [Example(task="gsm8k", prompt=gsm8k_prompt(r), reference=r["answer"]) for r in head(gsm8k_records())]
    if dataset == "xsum":
        return [
            Example(task="xsum", prompt=xsum_prompt(r), reference=r["summary"], extra={"id": r["id"]})
            for r in head(xsum_records())
        ]
    if dataset == "wmt14":
        return _wmt14(limit)
    if dataset == "cnn_dm":
        return [
            Example(task="cnn_dm", prompt=cnn_dm_prompt(r), reference=r["highlights"], extra={"question_id": r["question_id"]})
            for r in head(cnn_dm_records())
        ]
    if dataset == "nq":
        return [Example(task="nq", prompt=nq_prompt(r), reference=list(r["answer"])) for r in head(nq_open_records())]
    if dataset == "mt_bench":
        return [_first_turn("mt_bench", r, _first_reference(r)) for r in head(mt_bench_records())]
    raise ValueError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}, or pass --prompts FILE.jsonl")


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Examples from any JSONL with ``prompt``, optional ``reference`` (str or list) and ``task``.

    ``task`` defaults to ``"custom"``; ``limit`` is per task. Other fields go to ``extra``, so a
    file can carry e.g. the HumanEval fields that ``quality`` needs for its task.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    examples: list[Example] = []
    taken: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from e
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}, line {number}: no 'prompt' string")
            reference = record.pop("reference", None)
            if not (reference is None or isinstance(reference, (str, list))):
                raise ValueError(f"{path}, line {number}: 'reference' must be a string or a list")
            task = record.pop("task", "custom")
            if limit is not None and taken.get(task, 0) >= limit:
                continue
            taken[task] = taken.get(task, 0) + 1
            examples.append(Example(task=task, prompt=record.pop("prompt"), reference=reference, extra=record))
    return examples
