"""Choosing the search's winner on validation windows: pooled and per family, never on held-out prompts."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_dimr import FAST, ByteTokenizer, make_windows, sharpened

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask
from viasd_hf.calibration.corpus import FAMILIES, stratified_corpus
from viasd_hf.calibration.windows import Calibration, TeacherForcedReference
from viasd_hf.cli.search import add_search_command
from viasd_hf.dimr import (
    FAMILY_MASKS_FILENAME,
    budget,
    evaluate_mask,
    load_family_masks,
    mask_search,
    score_mask,
    search,
    search_budget,
    select_on_validation,
)
from viasd_hf.dimr.heldout import heldout_comparison, shipped_masks
from viasd_hf.dimr.objectives import MaskScore
from viasd_hf.dimr.report import heldout_markdown

CANDIDATES = [(1, 2, 3), (2, 5, 8), (4, 6, 9), (1, 7, 10), (3, 5, 6)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return sharpened(tiny_causal_lm("llama", num_hidden_layers=12))


@pytest.fixture(scope="module")
def validation(model):
    """Six validation windows, the first three of family ``a`` and the rest of family ``b``."""
    return TeacherForcedReference(model, make_windows(model, count=6, seed=1), progress=False)


FAMILY_OF = {"0": "a", "1": "a", "2": "a", "3": "b", "4": "b", "5": "b"}


def kl_on(model, windows, skip) -> float:
    return evaluate_mask(model, RoutingMask.from_model(model, skip=list(skip)), windows)["kl"]


def test_winner_is_the_validation_best_even_when_calibration_ranks_it_last(model, validation):
    on_validation = {skip: kl_on(model, validation, skip) for skip in CANDIDATES}
    ranked = sorted(CANDIDATES, key=on_validation.get, reverse=True)  # calibration order: validation worst first
    fake_calibration = [(skip, MaskScore(kl=0.1 * i, top1=0.5, via=0.1 * i, positions=10)) for i, skip in enumerate(ranked)]
    selection = select_on_validation(validation, fake_calibration, "kl")
    assert selection.winner.skipped == ranked[-1] == min(CANDIDATES, key=on_validation.get)
    assert selection.winner.calibration_rank == len(CANDIDATES)
    assert [f.validation.kl for f in selection.finalists] == pytest.approx([on_validation[s] for s in ranked])
    assert f"calibration rank {len(CANDIDATES)}" in selection.reason() and str(list(ranked[0])) in selection.reason()
    assert selection.family_winners == {} and selection.record()["winner"] == list(ranked[-1])


def test_each_family_wins_on_its_own_windows_and_pooling_weighs_positions(model, validation):
    finalists = [(skip, MaskScore(0.0, 1.0, 0.0, 1)) for skip in CANDIDATES]
    selection = select_on_validation(validation, finalists, "kl", FAMILY_OF)
    windows = {f: [w for w in validation.windows if FAMILY_OF[w.prompt_id] == f] for f in "ab"}
    for family, chosen in selection.family_winners.items():
        per_family = {skip: kl_on(model, windows[family], skip) for skip in CANDIDATES}
        assert chosen.skipped == min(CANDIDATES, key=per_family.get)
        assert chosen.families[family].kl == pytest.approx(per_family[chosen.skipped])
    assert set(selection.family_winners) == {"a", "b"}
    for finalist in selection.finalists:
        assert finalist.validation.kl == pytest.approx(kl_on(model, validation.windows, finalist.skipped))
    with pytest.raises(ValueError, match="without a task family"):
        select_on_validation(validation, finalists, "kl", {"0": "a"})
    with pytest.raises(ValueError, match="no finalists"):
        select_on_validation(validation, [], "kl")


def test_budget_keeps_its_best_finalists_in_calibration_order(model):
    reference = TeacherForcedReference(model, make_windows(model, count=3), progress=False)
    result = search_budget(model, reference, 0.25, "kl", iterations=8, patience=None, progress=False, finalists=4)
    values = [score.kl for _, score in result.finalists]
    assert len(result.finalists) == 4 and values == sorted(values)
    assert result.finalists[0][0] == result.skipped and values[0] == result.value


def test_search_selects_on_validation_not_calibration(model, monkeypatch, tmp_path):
    """A calibration objective that ranks masks in reverse of validation: the search must follow validation."""
    calibration = make_windows(model, count=3)
    validation = make_windows(model, count=3, seed=1)
    validation_reference = TeacherForcedReference(model, validation, progress=False)

    def reversed_objective(reference, mask, alpha1=0.5, alpha2=0.3):
        assert [w.prompt_id for w in reference.windows] == [w.prompt_id for w in calibration]
        real = score_mask(validation_reference, mask, alpha1, alpha2)
        return MaskScore(kl=10 - real.kl, top1=real.top1, via=10 - real.via, positions=real.positions)

    monkeypatch.setattr(budget, "score_mask", reversed_objective)  # what the search loop ranks by
    data = Calibration(calibration, validation, "test", 6, 10)
    mask = search(model, calibration=data, skip_ratio=0.25, finalists=5, out_dir=tmp_path, **FAST)
    record = mask.metadata["selection"]
    assert [f["calibration_rank"] for f in record["finalists"]] == [1, 2, 3, 4, 5]
    best_on_validation = min(record["finalists"], key=lambda f: f["validation_objective"])
    assert mask.skipped_layers == best_on_validation["skipped"] == record["winner"]
    assert best_on_validation["calibration_rank"] == 5  # the calibration best is the validation worst
    assert mask.metadata["heldout"]["kl"] == pytest.approx(best_on_validation["validation"]["kl"])
    rows = [json.loads(line) for line in (tmp_path / "search_log.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows if "phase" in r] == ["validation"] * 5 + ["selection"]
    assert not (tmp_path / FAMILY_MASKS_FILENAME).exists()  # no task families, no family masks
    one = search(model, calibration=data, skip_ratio=0.25, finalists=1, **FAST)
    assert one.metadata["selection"]["finalists"][0]["calibration_rank"] == 1  # one finalist: the calibration best


def test_stratified_search_never_sees_heldout_prompts_and_writes_family_masks(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("viasd_hf.models.loading.load_pretrained", lambda name, dtype=None: (model, ByteTokenizer()))
    monkeypatch.setattr("viasd_hf.cli.search.check_model", lambda name, flag: None)
    seen = {}
    real_select = mask_search.select_on_validation

    def spying(validation, finalists, *args, **kwargs):
        seen["validation"] = {w.prompt_id for w in validation.windows}
        return real_select(validation, finalists, *args, **kwargs)

    real_budget = budget.search_budget

    def spying_budget(target, reference, *args, **kwargs):
        seen["calibration"] = {w.prompt_id for w in reference.windows}
        return real_budget(target, reference, *args, **kwargs)

    monkeypatch.setattr(mask_search, "select_on_validation", spying)
    monkeypatch.setattr("viasd_hf.dimr.sweep.search_budget", spying_budget)
    parser = argparse.ArgumentParser(prog="viasd")
    add_search_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["search", "--target", "tiny", "--skip-ratio", "0.25", "--objective", "kl", "--iterations", "4",
                              "--finalists", "3", "--corpus", "stratified", "--num-prompts", "1", "--num-heldout", "1",
                              "--window", "4", "--depths", "0,4", "--max-prompt-tokens", "24", "--dtype", "float32",
                              "--out", str(out)])  # fmt: skip
    assert args.handler(args) == 0
    corpus = stratified_corpus(validation=1, calibration=1)
    heldout = {p.id for p in corpus.prompts("heldout")}
    assert seen["validation"] == {p.id for p in corpus.prompts("validation")}
    assert seen["calibration"] == {p.id for p in corpus.prompts("calibration")}
    assert heldout.isdisjoint(seen["validation"] | seen["calibration"])
    mask = RoutingMask.from_pretrained(out)
    assert "--finalists 3" in mask.metadata["search_command"]
    record = json.loads((out / FAMILY_MASKS_FILENAME).read_text())
    assert list(record["families"]) == list(FAMILIES) and record["k"] == len(mask.skipped_layers)
    assert record["general"]["skipped"] == mask.skipped_layers
    for family, entry in record["families"].items():
        assert entry["validation_prompt_ids"] == [p.id for p in corpus.splits["validation"][family]]
        assert entry["validation_objective"] <= entry["general_validation_objective"]
        assert len(entry["skipped"]) == record["k"]
    family_masks = load_family_masks(out)
    assert set(family_masks) == set(FAMILIES)
    for family, family_mask in family_masks.items():
        family_mask.validate_for(model)
        assert family_mask.skipped_layers == record["families"][family]["skipped"]
        assert family_mask.metadata["family"] == family
    shipped = shipped_masks(tmp_path)  # the held-out report judges each family mask on its own family
    assert list(shipped) == ["out", *(f"out/{family}" for family in FAMILIES)]
    result = heldout_comparison(model, ByteTokenizer(), shipped, stratified_corpus(), n_random=3, limit=1, window=4,
                                depths=(0,), max_prompt_tokens=24, progress=False)  # fmt: skip
    assert [entry["meant_for"] for entry in result["masks"]] == [None, *FAMILIES]
    markdown = heldout_markdown({"target": "tiny", "command": "python -m viasd_hf.dimr.heldout", **result})
    section = markdown.split("## Family masks against the general mask")[1].split("\n## ")[0]
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")] == [
        f"| `out/{family}`" for family in FAMILIES]  # fmt: skip
    assert markdown.count("meant for") == len(FAMILIES) and markdown.count("## `out") == 1


def test_family_masks_refuse_a_folder_of_another_target(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="--corpus stratified"):
        load_family_masks(tmp_path)
    RoutingMask.from_model(model, skip=[2, 3]).save_pretrained(tmp_path)
    (tmp_path / FAMILY_MASKS_FILENAME).write_text(json.dumps({"target_fingerprint": "other", "target_id": "x", "families": {}}))
    with pytest.raises(ValueError, match="another target"):
        load_family_masks(tmp_path)
