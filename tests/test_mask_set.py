"""Mask sets: a set per model pair on disk and on the Hub; a set decodes with its default mask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub, serve
from huggingface_hub import HfApi, constants

from conftest import tiny_causal_lm, work_done
from viasd_hf import MaskSet, RoutingMask, RoutingMaskError, ViaSDConfig, viasd_generate
from viasd_hf.cli import main
from viasd_hf.hub import files as hub_files
from viasd_hf.masks import repo as mask_repo
from viasd_hf.masks.resolver import clear_mask_cache, resolve_slim_masks

REPO = "viasd-test/routing-masks"
VOCAB = 8


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def drafter():
    return tiny_causal_lm("llama", seed=3, num_hidden_layers=2)


def two_masks(model) -> MaskSet:
    """A clearly worse default (six of eight layers skipped) and a good alternative (one skipped)."""
    bad = RoutingMask.from_model(model, skip=[1, 2, 3, 4, 5, 6])
    good = RoutingMask.from_model(model, skip=[3], objective="R", objective_value=0.1)
    return MaskSet({"bad": bad, "good": good})


def decode(model, drafter, config, ids, **kwargs):
    return model.generate(ids, custom_generate=viasd_generate, drafter=drafter, viasd_config=config, do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, **kwargs)


# --------------------------------------------------------------------------- a set in generate


@pytest.mark.parametrize("drafting", ["assistant", "prompt_lookup"])
def test_lossless_greedy_with_a_mask_set_is_generate_token_for_token(target, drafter, prompt_ids, drafting):
    config = ViaSDConfig.paper(routing_mask=two_masks(target), mode="lossless", adaptive=False, tau_accept=0.9, tau_escalate=0.8)
    options = {"drafter": drafter} if drafting == "assistant" else {"drafter": None, "prompt_lookup_num_tokens": 2}
    ids = prompt_ids.repeat(1, 2) if drafting == "prompt_lookup" else prompt_ids
    out = decode(target, options.pop("drafter"), config, ids, max_new_tokens=64, viasd_check_invariants=True, **options)
    expected = target.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    as_default = decode(target, drafter if drafting == "assistant" else None,
                        ViaSDConfig.paper(routing_mask=two_masks(target).default_mask, mode="lossless", adaptive=False,
                                          tau_accept=0.9, tau_escalate=0.8),
                        ids, max_new_tokens=64, **options)
    assert work_done(out.viasd_stats) == work_done(as_default.viasd_stats), "a set decodes with its default mask"


def test_a_set_of_one_is_its_mask(target, drafter, prompt_ids):
    mask = two_masks(target).masks["good"]
    config = dict(mode="tiered", adaptive=False, tau_accept=0.9, tau_escalate=0.8)
    single = decode(target, drafter, ViaSDConfig.paper(routing_mask=mask, **config), prompt_ids, max_new_tokens=32)
    as_set = decode(target, drafter, ViaSDConfig.paper(routing_mask=MaskSet({"only": mask}), **config), prompt_ids, max_new_tokens=32)
    assert torch.equal(single.sequences, as_set.sequences)
    assert resolve_slim_masks(MaskSet({"only": mask}), target, "self") is mask


# --------------------------------------------------------------------------- the set itself: checks, files, config


def test_a_set_is_checked_against_the_target_member_by_member(target, drafter, prompt_ids):
    other = tiny_causal_lm("llama", num_hidden_layers=6)
    foreign = MaskSet({"general": RoutingMask.from_model(other, skip=[2]), "code": RoutingMask.from_model(other, skip=[3])})
    with pytest.raises(RoutingMaskError, match="mask set member 'general': this routing mask is for a 6-layer model"):
        decode(target, drafter, ViaSDConfig(mode="tiered", routing_mask=foreign), prompt_ids, max_new_tokens=4)
    masks = two_masks(target)
    with pytest.raises(RoutingMaskError, match="are for different targets"):
        MaskSet({"general": masks.masks["good"], "other": foreign.masks["code"]})
    with pytest.raises(RoutingMaskError, match="keep the same layers"):
        MaskSet({"general": masks.masks["good"], "copy": masks.masks["good"]})
    with pytest.raises(RoutingMaskError, match="member name 'Code!' must be lowercase"):
        MaskSet({"Code!": masks.masks["good"]})
    with pytest.raises(RoutingMaskError, match="default 'nope' is not one of its members"):
        MaskSet(masks.masks, default="nope")


def test_renaming_the_default_is_checked_and_puts_it_first(target):
    masks = two_masks(target)
    with pytest.raises(RoutingMaskError, match=r"default 'nope' is not one of its members \['bad', 'good'\]"):
        masks.default = "nope"
    assert masks.default == "bad" and masks.default_mask is masks.masks["bad"]
    masks.default = "good"
    assert list(masks.masks) == ["good", "bad"] and masks.default_mask is masks.masks["good"]
    assert masks == MaskSet(two_masks(target).masks, default="good")


def test_a_set_saves_next_to_the_single_mask_and_rides_in_the_config(target, tmp_path):
    masks = MaskSet(two_masks(target).masks, default="good")
    masks.save_pretrained(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")) == [
        "mask_set.json", "masks/bad.json", "routing_mask.json"]
    assert RoutingMask.from_pretrained(tmp_path) == masks.default_mask  # readers of single masks get the default
    assert MaskSet.from_pretrained(tmp_path) == masks
    assert MaskSet.from_pretrained(tmp_path / "mask_set.json") == masks
    lone = tmp_path / "lone"
    masks.default_mask.save_pretrained(lone)
    assert MaskSet.from_pretrained(lone) == MaskSet({"default": masks.default_mask})
    config = ViaSDConfig(routing_mask=masks, mode="lossless")
    config.save_pretrained(tmp_path / "config")
    assert ViaSDConfig.from_pretrained(tmp_path / "config") == config
    with pytest.raises(TypeError, match="self_draft_mask must be a RoutingMask"):
        ViaSDConfig(mode="tiered", self_draft_mask=masks)


def test_a_single_mask_saved_over_a_set_leaves_that_mask_alone_and_says_so(target, tmp_path, caplog):
    two_masks(target).save_pretrained(tmp_path)
    (tmp_path / "masks" / "notes.txt").write_text("the user's own")
    single = RoutingMask.from_model(target, skip=[2])
    with caplog.at_level("WARNING", logger="viasd_hf"):
        single.save_pretrained(tmp_path)
    said = [record.getMessage() for record in caplog.records if record.name == "viasd_hf"]
    assert len(said) == 1 and "held a mask set; it now holds this one mask" in said[0]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "masks/notes.txt", "routing_mask.json"]
    assert MaskSet.from_pretrained(tmp_path) == MaskSet({"default": single})


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def three_masks(model) -> MaskSet:
    return MaskSet({"general": RoutingMask.from_model(model, skip=[3]), "code": RoutingMask.from_model(model, skip=[4]),
                    "chat": RoutingMask.from_model(model, skip=[5])}, default="general")


def test_a_save_that_fails_leaves_the_set_on_disk_as_it_was(target, tmp_path):
    """A member whose metadata JSON cannot hold (a numpy float, accepted when built) fails the save before anything is
    removed: the three members saved before are all there, byte for byte; so after a failing single-mask save."""
    import numpy as np

    three_masks(target).save_pretrained(tmp_path)
    before = files_of(tmp_path)
    assert len([name for name in before if name.endswith(".json")]) == 4  # three members and the index
    broken = three_masks(target)
    broken.masks["code"].metadata["score"] = np.float32(0.5)
    with pytest.raises(TypeError, match="float32"):
        broken.save_pretrained(tmp_path)
    assert files_of(tmp_path) == before
    single = RoutingMask.from_model(target, skip=[2])
    single.metadata["score"] = np.float32(0.5)
    with pytest.raises(TypeError, match="float32"):
        single.save_pretrained(tmp_path)
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("failing", ["writing the second file", "moving the third file in"])
def test_a_save_interrupted_on_disk_leaves_every_old_file(target, tmp_path, monkeypatch, failing):
    """A write that fails once files are being written (a full disk, an interrupt) leaves the old set whole, byte for
    byte, and no staging folder: the new files and the old set's removal are one change."""
    three_masks(target).save_pretrained(tmp_path)
    before = files_of(tmp_path)
    calls = {"write_text": 0, "replace": 0}
    real_write, real_replace = Path.write_text, os.replace

    def write_text(path, *args, **kwargs):
        calls["write_text"] += 1
        if failing == "writing the second file" and calls["write_text"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(path, *args, **kwargs)

    def replace(source, destination):
        if "new" in Path(source).parts:
            calls["replace"] += 1
            if failing == "moving the third file in" and calls["replace"] == 3:
                raise KeyboardInterrupt
        return real_replace(source, destination)

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(hub_files.os, "replace", replace)
    replacement = MaskSet({"general": RoutingMask.from_model(target, skip=[1]),
                           "maths": RoutingMask.from_model(target, skip=[2])}, default="general")
    with pytest.raises((OSError, KeyboardInterrupt)):
        replacement.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert files_of(tmp_path) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    replacement.save_pretrained(tmp_path)  # and once the disk is fine, the new set replaces the old one whole
    assert MaskSet.from_pretrained(tmp_path) == replacement
    assert sorted(files_of(tmp_path)) == ["mask_set.json", "masks/maths.json", "routing_mask.json"]


def test_a_config_or_mask_changed_to_a_wrong_value_after_it_was_built_is_refused_when_saved(target, tmp_path):
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]))
    config.save_pretrained(tmp_path)
    before = files_of(tmp_path)
    config.knobs.tau_escalate = 0.9  # above tau_accept
    with pytest.raises(ValueError, match="tau_accept"):
        config.save_pretrained(tmp_path)
    assert files_of(tmp_path) == before


# --------------------------------------------------------------------------- the set on the Hub test server


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """As in test_hub.py: an in-memory Hub the real client talks to; cache and shipped masks in tmp_path."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test_hub")
    monkeypatch.delenv(mask_repo.MASKS_REPO_ENV, raising=False)
    monkeypatch.setattr(mask_repo, "shipped_mask_dir", lambda: tmp_path / "shipped")
    monkeypatch.setattr(hub_files, "_UNREACHABLE", set())
    clear_mask_cache()
    with serve() as server:
        yield server
    clear_mask_cache()


def test_a_set_round_trips_through_the_hub_and_is_found_for_its_pair(fake_hub, target, monkeypatch):
    pair = ("tiny-random-llama", "self")
    masks = two_masks(target)
    masks.push_to_hub(REPO, endpoint=fake_hub.url, model=target)
    files = HfApi(endpoint=fake_hub.url).list_repo_files(REPO)
    folder = "tiny-random-llama/model-free"
    assert {f"{folder}/mask_set.json", f"{folder}/routing_mask.json", f"{folder}/masks/good.json", "README.md"} <= set(files)
    assert MaskSet.from_pretrained(REPO, subfolder=folder, endpoint=fake_hub.url) == masks
    assert MaskSet.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url) == masks
    assert RoutingMask.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url) == masks.default_mask
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    assert resolve_slim_masks(None, target, "self") == masks  # generate's default finds the pair's set

    smaller = MaskSet({"good": masks.masks["good"]})
    smaller.push_to_hub(REPO, endpoint=fake_hub.url)
    assert f"{folder}/masks/good.json" not in HfApi(endpoint=fake_hub.url).list_repo_files(REPO)  # no stale members
    assert MaskSet.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url) == smaller


def test_a_single_mask_pushed_or_pulled_over_a_set_replaces_the_whole_set(fake_hub, target, tmp_path):
    pair, folder = ("tiny-random-llama", "self"), "tiny-random-llama/model-free"
    two_masks(target).push_to_hub(REPO, endpoint=fake_hub.url)
    single = RoutingMask.from_model(target, skip=[2])
    single.push_to_hub(REPO, endpoint=fake_hub.url)
    files = HfApi(endpoint=fake_hub.url).list_repo_files(REPO)
    assert [path for path in files if path.startswith(folder)] == [f"{folder}/routing_mask.json"]
    assert MaskSet.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url) == MaskSet({"default": single})

    out = tmp_path / "pulled"
    two_masks(target).save_pretrained(out)
    assert main(["pull", "--target", pair[0], "--repo-id", REPO, "--endpoint", fake_hub.url, "--out", str(out)]) == 0
    assert MaskSet.from_pretrained(out) == MaskSet({"default": single})


def test_a_set_for_another_model_is_refused_on_push_and_on_use(fake_hub, target, tmp_path):
    other = tiny_causal_lm("llama", num_hidden_layers=6)
    foreign = MaskSet({"general": RoutingMask.from_model(other, skip=[2]), "code": RoutingMask.from_model(other, skip=[3])})
    with pytest.raises(RoutingMaskError, match="mask set member 'general'"):
        foreign.push_to_hub(REPO, endpoint=fake_hub.url, model=target)
    foreign.push_to_hub(REPO, subfolder="sets/other", endpoint=fake_hub.url)
    pulled = MaskSet.from_pretrained(REPO, subfolder="sets/other", endpoint=fake_hub.url)
    with pytest.raises(RoutingMaskError, match="mask set member 'general': this routing mask is for a 6-layer model"):
        resolve_slim_masks(pulled, target, "self")


def test_the_shipped_set_of_a_pair_is_found_before_its_single_mask(fake_hub, target, tmp_path):
    masks = two_masks(target)
    masks.save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "model-free")
    assert MaskSet.from_pretrained(("tiny-random-llama", "self"), endpoint=fake_hub.url) == masks
    with pytest.raises(RoutingMaskError, match="no routing mask for target 'tiny-random-qwen2'"):
        MaskSet.from_pretrained(("tiny-random-qwen2", "self"), endpoint=fake_hub.url)
