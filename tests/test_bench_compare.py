"""``python -m viasd_hf.bench.compare``: per-prompt ratios inside one run, medians, the lowest task, levers."""

from __future__ import annotations

import json

import pytest

from viasd_hf.bench.compare import levers_markdown, lowest_task_ratio, main, median_ratio, methods_markdown


def output(task: str, tokens: int, seconds: list[float]) -> dict:
    return {"task": task, "tokens": tokens, "seconds": seconds, "text": ""}


def row(speedup: float, **extra) -> dict:
    return {"speedup_vs_greedy": speedup, "quality": {"greedy_agreement": 1.0, "rougeL": 30.0}} | extra


@pytest.fixture
def run() -> dict:
    # per prompt, tokens/s: greedy 10, 10, 10; hf_assisted 20, 10, 40; viasd 20, 30, 20 (medians of the repeats)
    return {
        "command": "viasd bench ...",
        "options": {"dataset": "spec_bench", "temperature": None, "quantize": {}},
        "methods": {"greedy": row(1.0), "hf_assisted": row(2.0),
                    "viasd": row(2.0, slim_on_fraction=0.5, time_shares={"drafter": 0.4},
                                 quality={"greedy_agreement": 1.0, "full_model_agreement": 0.9876, "rougeL": 30.0})},
        "outputs": {
            "greedy": [output("qa", 10, [1.0]), output("rag", 10, [1.0]), output("qa", 10, [1.0])],
            "hf_assisted": [output("qa", 20, [1.0, 5.0, 1.0]), output("rag", 10, [1.0]), output("qa", 40, [1.0])],
            "viasd": [output("qa", 20, [1.0]), output("rag", 30, [1.0]), output("qa", 20, [1.0])],
            "two_tier": [output("qa", 10, [1.0]), output("rag", 10, [1.0]), output("qa", 10, [1.0])],
        },
    }


def test_ratios_are_per_prompt_then_the_median(run):
    # viasd ÷ hf_assisted per prompt: 1, 3, 0.5 → median 1; per task: qa median(1, 0.5) = 0.75, rag 3
    assert median_ratio(run, "viasd", "hf_assisted") == pytest.approx(1.0)
    assert lowest_task_ratio(run, "viasd", "hf_assisted") == ("qa", pytest.approx(0.75))
    assert median_ratio(run, "viasd", "two_tier") == pytest.approx(2.0)


def test_tables_name_the_reference_the_levers_and_what_is_missing(run, tmp_path, capsys):
    table = methods_markdown(run, "hf_assisted")
    assert "| viasd | 2.00 | 1.00 | 0.75 (qa) | 1.00 | 0.988 | rougeL 30.0 | 0.50 | 40% |" in table
    assert "| hf_assisted | 2.00 | – | – | 1.00 | – | rougeL 30.0 | – | – |" in table  # not measured in this run
    levers = levers_markdown([run])
    assert "| slim tier (tiered) | `viasd` ÷ `two_tier` | 2.00 |" in levers
    assert "draft vocabulary" not in levers  # neither of its methods ran
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert main([str(path)]) == 0
    assert "spec_bench ×3, greedy" in capsys.readouterr().out
