"""The ``viasd`` command end to end on the small zoo model (functional only: no timing is asserted)."""

from __future__ import annotations

import pytest

from viasd_hf.cli import main

pytestmark = pytest.mark.integration


def test_demo_small_prints_text_stats_and_speed(capsys):
    assert main(["demo", "--small", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "[viasd]" in out and "tokens per full call" in out
    assert "x greedy (same run)" in out
    assert "[mask]" in out


def test_profile_reports_slim_and_full_costs(capsys):
    assert main(["profile", "--target", "smollm2-135m-instruct", "--dtype", "float32", "--repeats", "1",
                 "--context", "32"]) == 0
    out = capsys.readouterr().out
    assert "| full | 1.00" in out and "| slim 45%" in out
