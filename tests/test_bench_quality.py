"""Task quality metrics of ``viasd_hf.bench.quality`` (offline, exact where the value is exact)."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from viasd_hf.bench.quality import humaneval_program, passes_tests, quality
from viasd_hf.data.datasets import data_dir
from viasd_hf.data.tasks import TASK_METRICS, Example, load_examples

CAT = "The cat sat on the mat. It was a sunny day in the garden."


def _one(task: str, reference: str | list[str] | None, output: str) -> dict[str, float]:
    return quality([Example(task=task, prompt="p", reference=reference)], [output])


# ---------------------------------------------------------------- summarisation: ROUGE-L


@pytest.mark.parametrize("task", ["summarization", "cnn_dm", "xsum"])
def test_rouge_identical_and_unrelated(task: str) -> None:
    assert _one(task, CAT, CAT) == {"rougeL": pytest.approx(100.0)}
    assert _one(task, CAT, "Quantum chromodynamics describes gluons.") == {"rougeL": 0.0}


def test_rouge_partial_and_mean() -> None:
    # LCS 3 of 3 predicted and 6 reference tokens: P = 1, R = 1/2, F = 2/3.
    assert _one("xsum", "the cat sat on the mat", "the cat sat") == {"rougeL": pytest.approx(200 / 3)}
    examples = [Example("xsum", "p", CAT), Example("xsum", "p", CAT)]
    assert quality(examples, [CAT, "Gluons."]) == {"rougeL": pytest.approx(50.0)}


def test_rouge_is_summary_level_over_sentences() -> None:
    # rougeLsum matches sentence by sentence: swapping two sentences costs nothing. Without the
    # sentence split it would be plain ROUGE-L of one line: LCS 3 of 6 tokens, 50.
    assert _one("summarization", "a b c. d e f.", "d e f. a b c.") == {"rougeL": pytest.approx(100.0)}


def test_rouge_skips_missing_references() -> None:
    examples = [Example("cnn_dm", "p", CAT), Example("cnn_dm", "p", None)]
    assert quality(examples, [CAT, "anything"]) == {"rougeL": pytest.approx(100.0)}
    assert _one("cnn_dm", None, CAT) == {}


# ---------------------------------------------------------------- translation: BLEU, chrF

SENTENCES = ["Gutach: Increased safety for pedestrians", "They are not even 100 metres apart."]


@pytest.mark.parametrize("task", ["translation", "wmt14"])
def test_bleu_chrf_identical(task: str) -> None:
    examples = [Example(task, "p", s) for s in SENTENCES]
    assert quality(examples, [f"  {s}\n" for s in SENTENCES]) == {
        "bleu": pytest.approx(100.0),
        "chrf": pytest.approx(100.0),
    }


def test_bleu_chrf_different() -> None:
    examples = [Example("wmt14", "p", s) for s in SENTENCES]
    scores = quality(examples, ["Gutach: more safety for walkers", "Completely unrelated words here."])
    assert 0.0 < scores["bleu"] < 50.0
    assert 0.0 < scores["chrf"] < 60.0
    assert quality(examples, ["xyz", "qqq"])["bleu"] == 0.0


# ---------------------------------------------------------------- maths: final-number exact match

GSM8K_REFERENCE = (
    "He pays 400*.5=$<<400*.5=200>>200 more\nSo it cost 600+400=$<<600+400=1000>>1000 in total.\n#### 1,000"
)


@pytest.mark.parametrize(
    ("output", "hit"),
    [
        ("The answer is $1000.", True),
        ("#### 1,000", True),
        ("Total: 1000.00 dollars", True),
        ("#### 1000\nI counted 999 of them before.", True),  # the number after the last ####
        ("I first got 1000, then 999.", False),  # else the last number
        ("#### 100", False),
        ("No idea.", False),
        ("#### about a thousand", False),
    ],
)
@pytest.mark.parametrize("task", ["gsm8k", "math_reasoning"])
def test_math_exact_match(task: str, output: str, hit: bool) -> None:
    assert _one(task, GSM8K_REFERENCE, output) == {"exact_match": 100.0 if hit else 0.0}


def test_math_exact_match_negative_and_mean() -> None:
    examples = [Example("gsm8k", "p", "#### -5"), Example("gsm8k", "p", "#### 20"), Example("gsm8k", "p", "#### 3")]
    # "10-20" is a range: 20, not -20. "x = -5." is -5.
    assert quality(examples, ["So x = -5.", "between 10-20", "#### 4"]) == {"exact_match": pytest.approx(200 / 3)}


def test_math_exact_match_on_real_gsm8k_answers() -> None:
    examples = load_examples("gsm8k", limit=5)
    assert quality(examples, [e.reference for e in examples]) == {"exact_match": 100.0}
    assert quality(examples, [e.reference + "\nActually, 7 is wrong." for e in examples]) == {"exact_match": 100.0}


# ---------------------------------------------------------------- QA: normalised contains-match


@pytest.mark.parametrize(
    ("answers", "output", "hit"),
    [
        (["Elizabeth Dean Lail"], "Anna was played by ELIZABETH DEAN LAIL.", True),
        (["The Beatles"], "It was written by Beatles.", True),  # articles dropped on both sides
        (["14 December 1972 UTC", "December 1972"], "The last landing was in December, 1972!", True),
        (["St. Louis"], "In st louis", True),  # punctuation dropped
        (["one"], "Someone knows.", False),  # whole words only
        (["Bobby Scott", "Bob Russell"], "Paul McCartney", False),
        ("Paris", "Paris, of course.", True),  # a single reference string
    ],
)
@pytest.mark.parametrize("task", ["qa", "nq", "rag"])
def test_answer_exact_match(task: str, answers: str | list[str], output: str, hit: bool) -> None:
    assert _one(task, answers, output) == {"exact_match": 100.0 if hit else 0.0}


def test_answer_exact_match_skips_missing_references() -> None:
    examples = [Example("qa", "p", ["Rome"]), Example("qa", "p", None), Example("qa", "p", ["Paris"])]
    assert quality(examples, ["Rome.", "whatever", "Lyon"]) == {"exact_match": 50.0}
    assert quality(examples[1:2], ["whatever"]) == {}


def test_answer_exact_match_on_real_spec_bench() -> None:
    examples = [e for e in load_examples("spec_bench", limit=3) if e.task in ("qa", "rag")]
    qa = [e for e in examples if e.task == "qa"]
    rag = [e for e in examples if e.task == "rag"]
    assert quality(qa, [f"I think it is {e.reference[-1]}." if e.reference else "?" for e in qa]) == {
        "exact_match": 100.0
    }
    assert quality(rag, [f"Well: {e.reference[0]}" for e in rag]) == {"exact_match": 100.0}


# ---------------------------------------------------------------- HumanEval: pass@1


def _canonical_solutions() -> dict[str, str]:
    with gzip.open(data_dir() / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        return {r["task_id"]: r["canonical_solution"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def humaneval() -> tuple[list[Example], list[str]]:
    examples = load_examples("humaneval", limit=2)
    solutions = _canonical_solutions()
    return examples, [solutions[e.extra["task_id"]] for e in examples]


def test_pass_at_1_canonical_body(humaneval: tuple[list[Example], list[str]]) -> None:
    examples, bodies = humaneval
    assert quality(examples, bodies) == {"pass@1": 100.0}
    # The body in a fenced block, as a chat model replies.
    assert quality(examples, [f"Sure:\n```python\n{b}```\nHope it helps." for b in bodies]) == {"pass@1": 100.0}


def test_pass_at_1_complete_function(humaneval: tuple[list[Example], list[str]]) -> None:
    examples, bodies = humaneval
    full = [f"```python\n{e.extra['code_prompt']}{b}```" for e, b in zip(examples, bodies)]
    assert quality(examples, full) == {"pass@1": 100.0}
    # Just the function, without the prompt's `from typing import List`: the prompt supplies it.
    functions = [e.extra["code_prompt"][e.extra["code_prompt"].index("def ") :] for e in examples]
    bare = [f"```py\n{function}{b}" for function, b in zip(functions, bodies)]
    assert quality(examples, bare) == {"pass@1": 100.0}  # also: a block cut off before its closing fence


def test_pass_at_1_wrong(humaneval: tuple[list[Example], list[str]]) -> None:
    examples, bodies = humaneval
    assert quality(examples, ["    return None\n", "    return []\n"]) == {"pass@1": 0.0}
    assert quality(examples, [bodies[0], "    return []\n"]) == {"pass@1": 50.0}
    wrong_function = "```python\ndef separate_paren_groups(s):\n    return 1\n```"
    assert quality(examples, ["I cannot help with that.", wrong_function]) == {"pass@1": 0.0}


def test_humaneval_program_prefers_a_python_block(humaneval: tuple[list[Example], list[str]]) -> None:
    examples, bodies = humaneval
    reply = f"Usage:\n```\n$ python run.py\n```\nCode:\n```python\n{bodies[0]}```"
    program = humaneval_program(examples[0], reply)
    assert program.startswith(examples[0].extra["code_prompt"] + bodies[0])
    assert "run.py" not in program
    assert program.endswith("\n\ncheck(has_close_elements)\n")
    assert passes_tests(program)


def test_passes_tests_exit_status() -> None:
    assert passes_tests("assert 1 + 1 == 2\n")
    assert not passes_tests("assert 1 + 1 == 3\n")
    assert not passes_tests("import sys\nsys.exit(3)\n")
    assert not passes_tests("def broken(:\n")


def test_passes_tests_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIASD_SECRET_MARKER", "1")
    program = (
        "import os, sys\n"
        "assert 'VIASD_SECRET_MARKER' not in os.environ\n"
        "assert sorted(os.listdir('.')) == ['program.py']\n"
        "assert sys.flags.isolated == 1\n"
        "assert sys.stdin is None or sys.stdin.read() == ''\n"
    )
    assert passes_tests(program)


def test_passes_tests_timeout() -> None:
    start = time.perf_counter()
    assert not passes_tests("while True:\n    pass\n", timeout=2)
    assert 1.9 < time.perf_counter() - start < 10.0


# ---------------------------------------------------------------- dispatch and errors


def test_no_metric_tasks() -> None:
    assert _one("mt_bench", None, "anything") == {}
    assert _one("custom", "ref", "anything") == {}
    assert _one("my_task", "ref", "anything") == {}
    assert quality([], []) == {}


def test_metric_names_match_task_metrics(humaneval: tuple[list[Example], list[str]]) -> None:
    examples, bodies = humaneval
    for task, names in TASK_METRICS.items():
        if task == "humaneval":
            scores = quality(examples[:1], bodies[:1])
        else:
            scores = _one(task, "#### 1", "#### 1")
        assert tuple(scores) == names, task


def test_mixed_tasks_and_lengths() -> None:
    with pytest.raises(ValueError, match="one task at a time"):
        quality([Example("qa", "p", ["a"]), Example("nq", "p", ["a"])], ["a", "a"])
    with pytest.raises(ValueError, match="2 examples but 1 outputs"):
        quality([Example("qa", "p", ["a"]), Example("qa", "p", ["a"])], ["a"])

