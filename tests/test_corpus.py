"""The stratified corpus (disjoint, deterministic splits of six families), deep windows, the per-family held-out report."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_dimr import ByteTokenizer, sharpened

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask
from viasd_hf.calibration.corpus import FAMILIES, HELDOUT_PER_FAMILY, SPLITS, content_keys, pool, stratified_corpus
from viasd_hf.calibration.windows import Prompt, Window, at_depths, build_windows
from viasd_hf.cli.search import add_search_command
from viasd_hf.dimr.heldout import heldout_comparison, heldout_prompts
from viasd_hf.dimr.report import heldout_markdown


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return sharpened(tiny_causal_lm("llama", num_hidden_layers=8))


def test_every_family_is_in_every_split_and_no_prompt_or_text_is_in_two():
    corpus = stratified_corpus(validation=3, calibration=5)
    assert corpus.families == list(FAMILIES) == ["chat", "translation", "summarisation", "qa", "maths", "code"]
    sizes = {"heldout": HELDOUT_PER_FAMILY, "validation": 3, "calibration": 5}
    for split in SPLITS:
        assert {family: len(corpus.splits[split][family]) for family in FAMILIES} == dict.fromkeys(FAMILIES, sizes[split])
        assert all(p.category == family for family in FAMILIES for p in corpus.splits[split][family])
    ids = [p.id for split in SPLITS for p in corpus.prompts(split)]
    keys = content_keys(ids)
    assert len(set(ids)) == len(ids) and len(set(keys.values())) == len(ids)
    strata = {p.id.split(":")[0] for p in corpus.prompts("heldout")}
    assert {"wmt14-de-en", "wmt14-en-de", "wmt14-en-fr", "xsum", "cnn_dm", "nq_open", "spec_bench-rag", "gsm8k", "humaneval"} <= strata


def test_splits_are_deterministic_and_the_heldout_split_ignores_the_other_sizes():
    corpus = stratified_corpus(validation=3, calibration=5, seed=0)
    assert stratified_corpus(validation=3, calibration=5, seed=0) == corpus
    bigger = stratified_corpus(validation=6, calibration=20, seed=0)
    assert bigger.splits["heldout"] == corpus.splits["heldout"]
    assert stratified_corpus(validation=3, calibration=5, seed=1).splits["heldout"] != corpus.splits["heldout"]
    with pytest.raises(ValueError, match="chat"):
        stratified_corpus(validation=30, calibration=30)  # chat has 60 prompts


def test_the_same_text_in_two_files_is_one_prompt_and_old_spec_bench_ids_resolve():
    corpus_keys = {entry.key for strata in pool().values() for entries in strata.values() for entry in entries}
    spec_bench_ids = [str(i) for i in (161, 241, 321, 401, 481, 81, 121)]  # translation, summ., qa, maths, rag, chat, coding
    assert set(content_keys(spec_bench_ids).values()) <= corpus_keys
    translation = {entry.key for entries in pool()["translation"].values() for entry in entries}
    assert content_keys(["161"])["161"] in translation  # Spec-Bench's tokenised line is a WMT14 line
    assert "spec_bench-math_reasoning" not in pool()["maths"]  # Spec-Bench maths is GSM8K, kept once
    with pytest.raises(KeyError):
        content_keys(["nq_open:99999"])


def test_windows_start_at_several_depths_and_reach_beyond_position_16(model):
    prompts = [Prompt(str(i), f"prompt {i}") for i in range(2)]
    windows = build_windows(model, ByteTokenizer(), prompts, window=8, depths=(0, 16, 32), progress=False)
    assert [w.depth for w in windows] == [0, 16, 32] * 2
    prompt_length = len(ByteTokenizer().encode("prompt 0"))
    for window in windows:
        assert window.start == prompt_length - 1 + window.depth and window.positions == 8
    assert max(w.start + w.positions - (prompt_length - 1) for w in windows) == 40  # continuation tokens scored
    short = Window("p", torch.arange(14)[None], start=3)  # a continuation that stopped after 10 tokens
    assert [(w.depth, w.positions) for w in at_depths(short, (0, 8, 16), window=4)] == [(0, 4), (8, 2)]
    with pytest.raises(ValueError):
        build_windows(model, ByteTokenizer(), prompts, depths=())


def test_heldout_report_has_a_row_per_family_and_mask_and_drops_prompts_a_search_used(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    corpus = stratified_corpus()
    used_chat = corpus.splits["heldout"]["chat"][0]
    legacy_translation = "161"  # a bare Spec-Bench id, as older masks record them
    masks = {
        "model-free": RoutingMask.from_model(model, skip=[2, 5], metadata={"calibration_prompt_ids": [used_chat.id]}),
        "self-draft": RoutingMask.from_model(model, skip=[1, 3, 4], metadata={"heldout_prompt_ids": [legacy_translation]}),
    }
    kept, dropped = heldout_prompts(corpus, [used_chat.id], limit=None)
    assert dropped["chat"] == [used_chat.id] and used_chat not in kept["chat"] and len(kept["chat"]) == HELDOUT_PER_FAMILY - 1
    result = heldout_comparison(model, ByteTokenizer(), masks, corpus, n_random=7, limit=1, window=4, depths=(0, 20),
                                max_prompt_tokens=24, progress=False)  # fmt: skip
    assert result["heldout"]["chat"]["prompts"] != [used_chat.id]
    assert [entry["folder"] for entry in result["masks"]] == ["model-free", "self-draft"]
    for entry in result["masks"]:
        assert list(entry["families"]) == [*FAMILIES, "all"]
        row = entry["families"]["qa"]
        assert len(row["random"]["kl"]["values"]) == 7 and row["random"]["kl"]["min"] <= row["random"]["kl"]["median"]
        assert all(len(skip) == entry["k"] for skip in row["random_skipped"])
    markdown = heldout_markdown({"target": "tiny", "command": "python -m viasd_hf.dimr.heldout --target tiny", **result})
    for folder in masks:
        section = markdown.split(f"## `{folder}`")[1].split("\n## ")[0]
        assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
            *(f"| {family}" for family in FAMILIES), "| **all**"]  # fmt: skip
    assert markdown.count("beats the random median on held-out KL in") == 2


def test_search_command_with_the_stratified_corpus(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("viasd_hf.models.loading.load_pretrained", lambda name, dtype=None: (model, ByteTokenizer()))
    monkeypatch.setattr("viasd_hf.cli.search.check_model", lambda name, flag: None)
    parser = argparse.ArgumentParser(prog="viasd")
    add_search_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["search", "--target", "tiny", "--skip-ratio", "0.25", "--objective", "kl", "--iterations", "2",
                              "--corpus", "stratified", "--num-prompts", "1", "--num-heldout", "1", "--window", "4",
                              "--depths", "0,8", "--max-prompt-tokens", "24", "--dtype", "float32",
                              "--out", str(tmp_path / "out")])  # fmt: skip
    assert args.handler(args) == 0
    mask = RoutingMask.from_pretrained(tmp_path / "out")
    calibration, validation = mask.metadata["calibration_prompt_ids"], mask.metadata["heldout_prompt_ids"]
    assert len(calibration) == len(validation) == len(FAMILIES)
    heldout = {p.id for p in stratified_corpus().prompts("heldout")}
    assert heldout.isdisjoint(calibration) and heldout.isdisjoint(validation)
    assert "--corpus stratified" in mask.metadata["search_command"] and "--depths 0,8" in mask.metadata["search_command"]
    assert "windows at continuation depths 0,8" in mask.calibration
