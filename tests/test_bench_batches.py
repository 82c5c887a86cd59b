"""``viasd bench --batch-size``: the sweep decodes each batch size in batches of that size, compares rows with
batched greedy, and refuses what a batch cannot compare."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import near_copy, tiny_causal_lm
from viasd_hf import ViaSDConfig, generation
from viasd_hf.bench.batches import batch_markdown, left_pad, run_batch_sweep, until_eos
from viasd_hf.cli import main
from viasd_hf.generation import enabled_generate

REPO = Path(__file__).resolve().parents[1]
PAD = 0


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


def test_left_pad_right_aligns_each_prompt_and_masks_the_padding():
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8]]), torch.tensor([[9, 10]])]
    input_ids, attention_mask = left_pad(prompts, PAD)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_a_row_counts_its_tokens_up_to_and_including_its_first_eos():
    assert until_eos([4, 5, 2, 0, 0], {2}) == [4, 5, 2]
    assert until_eos([4, 5, 6], {2}) == [4, 5, 6]
    assert until_eos([3, 4], {2, 3}) == [3]


def test_the_sweep_decodes_every_batch_size_in_batches_of_that_size_and_matches_batched_greedy(monkeypatch):
    target = tiny_causal_lm("llama")
    drafter = near_copy(target, seed=1)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (1, length), generator=generator) for length in (5, 9, 3, 7, 6)]
    shapes = []

    def recording(input_ids, *args, viasd_config=None, **kwargs):
        shapes.append((input_ids.shape[0], viasd_config is not None))
        return enabled_generate(input_ids, *args, viasd_config=viasd_config, **kwargs)

    @contextmanager
    def load():
        shapes.append("load on")
        yield
        shapes.append("load off")

    monkeypatch.setattr(generation, "enabled_generate", recording)  # what enable_viasd binds
    rows = run_batch_sweep(target, drafter, ViaSDConfig(use_slim=False), prompts, [2, 4], max_new_tokens=6, pad_token_id=PAD,
                           load=load())
    assert shapes[4] == "load on" and shapes[-1] == "load off", "a --load is held over the timed calls only"
    timed = shapes[5:-1]  # after the four warm-up calls
    one_at_a_time = [(1, False)] * 5 + [(1, True)] * 5  # HF assisted, then VIA-SD, one prompt each
    assert timed[:10] == one_at_a_time
    assert sorted(timed[10:]) == sorted([(2, False), (2, True)] * 2 + [(1, False), (1, True)] + [(4, False), (4, True)]
                                        + [(1, False), (1, True)])
    assert [row.batch_size for row in rows] == [2, 4]
    for row in rows:
        assert row.rows == 5 and row.rows_identical_to_greedy == 5  # lossless in float32: every row as greedy's
        assert 0 < row.new_tokens <= 5 * 6
        assert row.viasd_over_greedy > 0 and row.viasd_over_hf_one_at_a_time > 0 and row.viasd_over_viasd_batch_1 > 0
        assert 0 <= row.viasd_plain_block_share <= 1 and row.viasd_verdict.startswith(("speculating", "plain decoding"))
    table = batch_markdown(rows)
    assert table.splitlines()[2].startswith("| 2 |") and "5/5 |" in table and table.splitlines()[0].endswith("blocks plain |")


@pytest.mark.parametrize(("extra", "flag"), [
    (["--methods", "greedy,viasd_lossless"], "--methods"),
    (["--temperature", "0.7"], "--temperature"),
    (["--quantize", "drafter=bnb-4bit"], "--quantize"),
])
def test_a_batch_sweep_refuses_what_it_cannot_compare_before_loading_models(extra, flag, capsys):
    assert main(["bench", "--target", "no-such-model-anywhere", "--batch-size", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert f"leave out {flag}" in err and "--batch-size" in err


def test_a_batch_size_must_be_whole_numbers(capsys):
    assert main(["bench", "--batch-size", "2,0"]) == 2
    assert "argument --batch-size: expected a whole number >= 1, got 0" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_cli_runs_a_batch_sweep(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "task": task}) + "\n" for text, task in [
        ("Say hello.", "chat"), ("Name three colours.", "qa"), ("Count to five.", "chat")]))
    report = tmp_path / "batches.json"
    assert main(["bench", "--target", "smollm2-135m-instruct", "--drafter", "smollm2-135m-instruct",
                 "--mask", str(REPO / "hub_masks" / "smollm2-135m-instruct" / "model-free"), "--dtype", "float32",
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--batch-size", "1,2",
                 "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert [row["batch_size"] for row in data["batches"]] == [1, 2]
    assert all(row["rows"] == 3 and row["rows_identical_to_greedy"] == 3 for row in data["batches"])
    assert data["tasks"] == {"chat": 2, "qa": 1} and data["options"]["batch_size"] == [1, 2]
    assert all(0 <= row["viasd_plain_block_share"] <= 1 for row in data["batches"])
    assert "| 2 |" in capsys.readouterr().out
