"""Task quality metrics, computed offline, reported on the 0-100 scale papers use.

Speculative decoding should not change what a model says (greedy) or its distribution (sampling);
these scores check that on the task's own terms, next to the speed numbers. Which metric a task
gets is declared in :data:`viasd_hf.data.tasks.TASK_METRICS`.
"""

from __future__ import annotations

import os
import re
import string
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from viasd_hf.data.tasks import Example
from viasd_hf.extras import require

sacrebleu = require("sacrebleu", "bench", "viasd bench")
rouge_scorer = require("rouge_score.rouge_scorer", "bench", "viasd bench")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# A minus sign only when it does not join two numbers ("10-20" is 10 and 20, not 10 and -20).
_NUMBER = re.compile(r"(?:(?<!\d)-)?\d[\d,]*(?:\.\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)  # \Z: a reply cut off by max_new_tokens


def _scored(examples: list[Example], outputs: list[str]) -> list[tuple[Example, str]]:
    """Pairs whose example has a reference: the others cannot be scored."""
    return [(e, o) for e, o in zip(examples, outputs) if e.reference is not None]


def _text_reference(example: Example) -> str:
    """A single reference string; for a list of references, the first."""
    ref = example.reference
    return ref if isinstance(ref, str) else ref[0]


def _sentence_lines(text: str) -> str:
    """One sentence per line, which rougeLsum needs; a regex, since nltk punkt data is not offline."""
    return "\n".join(_SENTENCE_END.split(text.strip()))


def _rouge_l(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    pairs = _scored(examples, outputs)
    if not pairs:
        return {}
    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True)
    scores = [
        scorer.score(_sentence_lines(_text_reference(e)), _sentence_lines(o))["rougeLsum"].fmeasure for e, o in pairs
    ]
    return {"rougeL": 100.0 * sum(scores) / len(scores)}


def _bleu_chrf(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    pairs = _scored(examples, outputs)
    if not pairs:
        return {}
    hypotheses = [o.strip() for _, o in pairs]
    references = [[_text_reference(e) for e, _ in pairs]]
    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, references, tokenize="13a").score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, references).score,
    }


def _final_number(text: str) -> float | None:
    """GSM8K's answer convention: the number after the last ``####``, else the text's last number.

    Commas, ``$`` and a trailing full stop are dropped, so "#### 1,000" and "$1000." agree.
    """
    _, marker, tail = text.replace("$", "").rpartition("####")  # without a marker, tail is all the text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    return float((numbers[0] if marker else numbers[-1]).replace(",", ""))


def _math_exact_match(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    pairs = _scored(examples, outputs)
    if not pairs:
        return {}
    hits = 0
    for e, o in pairs:
        predicted = _final_number(o)
        hits += int(predicted is not None and predicted == _final_number(_text_reference(e)))
    return {"exact_match": 100.0 * hits / len(pairs)}


def _normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _contains_answer(prediction: str, answers: list[str]) -> bool:
    padded = f" {_normalize_answer(prediction)} "
    return any(f" {a} " in padded for a in map(_normalize_answer, answers) if a)


def _answer_exact_match(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    """Contains-match, as is usual for chat models on NQ: a hit when any acceptable answer occurs in
    the reply, after SQuAD normalisation, as whole words (so "one" does not match "someone").
    Chat models answer in sentences, so the strict SQuAD equality would score almost nothing.
    """
    pairs = _scored(examples, outputs)
    if not pairs:
        return {}
    hits = 0
    for e, o in pairs:
        answers = [e.reference] if isinstance(e.reference, str) else e.reference
        hits += int(_contains_answer(o, answers))
    return {"exact_match": 100.0 * hits / len(pairs)}


def _extract_code(output: str) -> str:
    """The first ```python block, else the first fenced block of any kind, else the whole reply."""
    blocks = _FENCE.findall(output)
    for language, body in blocks:
        if language.strip().lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else output


def humaneval_program(example: Example, output: str) -> str:
    """The program whose exit status decides whether ``output`` solves a HumanEval problem.

    A reply that writes the whole function still goes after the prompt: the prompt carries the
    imports (``from typing import List``) and helper functions that replies routinely leave out,
    and the reply's ``def`` replaces the prompt's docstring-only stub. A reply without the ``def``
    is taken as the body that continues the prompt.
    """
    code = _extract_code(output)
    entry_point = example.extra["entry_point"]
    code_prompt = example.extra["code_prompt"]
    defines_entry = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
    program = f"{code_prompt}\n{code}" if defines_entry else code_prompt + code
    return f"{program}\n\n{example.extra['test']}\n\ncheck({entry_point})\n"


def passes_tests(program: str, timeout: float = 10.0) -> bool:
    """Whether ``program`` exits with status 0 within ``timeout`` seconds.

    It runs in a fresh isolated interpreter (``-I``), in an empty temporary directory, with stdin
    closed and only ``PATH`` in its environment, so one program cannot see or break another. This
    keeps accidents contained; it is not a security sandbox for hostile code.
    """
    with tempfile.TemporaryDirectory(prefix="viasd_humaneval_") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8")
        try:
            result = subprocess.run(
                [sys.executable, "-I", script.name],
                cwd=tmp,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "")},
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def _pass_at_1(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    if not examples:
        return {}
    programs = [humaneval_program(e, o) for e, o in zip(examples, outputs)]
    # Threads suffice: each waits on its own subprocess, and a timed-out program costs only its slot.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        passed = list(pool.map(passes_tests, programs))
    return {"pass@1": 100.0 * sum(passed) / len(passed)}


_SCORERS: dict[str, Callable[[list[Example], list[str]], dict[str, float]]] = {
    "summarization": _rouge_l,
    "cnn_dm": _rouge_l,
    "xsum": _rouge_l,
    "translation": _bleu_chrf,
    "wmt14": _bleu_chrf,
    "math_reasoning": _math_exact_match,
    "gsm8k": _math_exact_match,
    "qa": _answer_exact_match,
    "nq": _answer_exact_match,
    "rag": _answer_exact_match,
    "humaneval": _pass_at_1,
}


def quality(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    """Corpus-level scores of ``outputs`` for ``examples`` of one task (names: ``TASK_METRICS``).

    Examples without a reference are left out of reference-based metrics; a metric no example can
    be scored on is omitted. Tasks without a metric (``mt_bench``, custom prompts) give ``{}``.
    """
    if len(examples) != len(outputs):
        raise ValueError(f"{len(examples)} examples but {len(outputs)} outputs")
    tasks = sorted({e.task for e in examples})
    if len(tasks) > 1:
        raise ValueError(f"quality() scores one task at a time, got {tasks}")
    if not tasks or tasks[0] not in _SCORERS:
        return {}
    return _SCORERS[tasks[0]](examples, outputs)
