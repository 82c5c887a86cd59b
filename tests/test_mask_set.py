"""Mask sets: a set per model pair on disk and on the Hub, and the online choice among its masks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub, serve
from huggingface_hub import HfApi, constants

from conftest import assert_stats_consistent, tiny_causal_lm
from viasd_hf import MaskSet, RoutingMask, RoutingMaskError, ViaSDConfig, viasd_generate
from viasd_hf.cli import main
from viasd_hf.control.mask_chooser import MaskChoice, MaskChooser
from viasd_hf.control.memory import mask_chooser, tier_memory
from viasd_hf.engine.policies import BlockResult, SlimCheck, Tiers
from viasd_hf.engine.verifier import TierLogits
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


# --------------------------------------------------------------------------- the chooser on synthetic observations


def rows_with_top(tokens: list[int]) -> TierLogits:
    """A pass whose top token at row i is tokens[i]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[range(len(tokens)), tokens] = 5.0
    return TierLogits(logits, logits.clone())


def checked_block(full: list[int], slim: list[int], probe: list[int] | None) -> BlockResult:
    check = SlimCheck(rows_with_top(slim), rows_with_top(full), len(full), rows_with_top(probe) if probe else None)
    return BlockResult([0], ["full"], rows_with_top(full), 0, 0, "full", escalated=True,
                       passes={"slim": 1, "full": 1}, check=check)


def run_synthetic(choice: MaskChoice, agreement: dict[str, float], blocks: int, rows: int = 5) -> None:
    """Feed ``blocks`` escalated blocks; each mask agrees with the full model on the first agreement[mask]·rows rows."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(blocks):
        choice.tiers(Tiers(None, None, None))
        running, probed = choice.planned
        full = torch.randint(0, VOCAB, (rows,), generator=generator).tolist()

        def seen_by(name: str) -> list[int]:
            right = round(agreement[name] * rows)
            return full[:right] + [(token + 1) % VOCAB for token in full[right:]]

        choice.observe(checked_block(full, seen_by(running), seen_by(probed) if probed else None))


def synthetic_choice(*names: str) -> MaskChoice:
    return MaskChoice(dict.fromkeys(names), MaskChooser(list(names), names[0]))


def test_the_chooser_switches_to_a_mask_that_clearly_agrees_more_and_says_why():
    choice = synthetic_choice("bad", "good")
    run_synthetic(choice, {"bad": 0.2, "good": 1.0}, blocks=40)
    report = choice.report()
    assert report["default"] == "bad" and report["chosen"] == "good"
    assert len(report["switches"]) == 1 and report["switches"][0]["from"] == "bad"
    assert "'good' agreed with the full model where 'bad' did not" in report["reason"]
    masks = report["masks"]
    assert masks["good"]["agreement"] == 1.0 and masks["bad"]["agreement"] == pytest.approx(0.2)
    assert masks["bad"]["escalation_rate"] == 1.0 and masks["bad"]["probes"] >= 1 and masks["good"]["slim_blocks"] > 0


def test_the_chooser_keeps_the_default_when_no_mask_is_clearly_better():
    choice = synthetic_choice("a", "b", "c")
    run_synthetic(choice, {"a": 0.6, "b": 0.6, "c": 0.6}, blocks=200)
    report = choice.report()
    assert report["chosen"] == "a" and not report["switches"] and "kept the mask it started with" in report["reason"]
    assert report["masks"]["b"]["probes"] and report["masks"]["c"]["probes"]  # the alternatives are taken in turn
    assert choice.chooser.probe_interval == choice.chooser.probe_every  # undecided: probing goes on at the base rate


def test_probes_back_off_while_every_alternative_is_clearly_worse():
    choice = synthetic_choice("good", "bad")
    run_synthetic(choice, {"good": 1.0, "bad": 0.0}, blocks=300)
    chooser = choice.chooser
    assert chooser.running == "good" and chooser.probe_interval == chooser.max_probe_every
    assert choice.records["bad"].probes < 300 / chooser.probe_every


# --------------------------------------------------------------------------- the chooser inside generate


def test_generate_picks_the_better_mask_of_a_set_reproducibly(target, drafter, prompt_ids):
    config = ViaSDConfig(mode="tiered", routing_mask=two_masks(target), adaptive=False, tau_accept=0.9, tau_escalate=0.8)
    first = decode(target, drafter, config, prompt_ids, max_new_tokens=96)
    choice = first.viasd_stats.mask_choice
    assert choice["default"] == choice["started_with"] == "bad" and choice["chosen"] == "good", choice
    assert choice["masks"]["good"]["agreement"] > choice["masks"]["bad"]["agreement"]
    assert_stats_consistent(first.viasd_stats, first.sequences.shape[1] - prompt_ids.shape[1], "tiered")
    again = decode(target, drafter, config, prompt_ids, max_new_tokens=96)
    assert torch.equal(again.sequences, first.sequences) and again.viasd_stats.mask_choice["switches"] == choice["switches"]


def test_measured_tier_switching_remembers_the_choice_until_the_memory_is_reset(target, drafter, prompt_ids):
    masks = two_masks(target)
    measured = ViaSDConfig(mode="tiered", routing_mask=masks, tau_accept=0.9, tau_escalate=0.8, tier_switching="measured")
    fixed = ViaSDConfig(mode="tiered", routing_mask=masks, tau_accept=0.9, tau_escalate=0.8, tier_switching="fixed")
    memory = tier_memory(target)
    memory.reset()
    remembered = mask_chooser(target, masks, "drafter", measured, do_sample=False)
    assert mask_chooser(target, masks, "drafter", measured, do_sample=False) is remembered
    assert mask_chooser(target, masks, "drafter", fixed, do_sample=False) is not remembered  # reproducible: afresh
    memory.reset()
    assert mask_chooser(target, masks, "drafter", measured, do_sample=False) is not remembered
    memory.reset()

    def started_with(config: ViaSDConfig) -> str:
        return decode(target, drafter, config, prompt_ids, max_new_tokens=8).viasd_stats.mask_choice["started_with"]

    assert started_with(measured) == "bad"
    (chooser,) = memory.choosers.values()
    chooser.running = "good"  # as if an earlier call had chosen it
    assert started_with(measured) == "good" and started_with(fixed) == "bad"
    memory.reset()
    assert started_with(measured) == "bad"


@pytest.mark.parametrize("drafting", ["assistant", "prompt_lookup"])
def test_lossless_greedy_with_a_mask_set_is_generate_token_for_token(target, drafter, prompt_ids, drafting):
    config = ViaSDConfig(routing_mask=two_masks(target), mode="lossless", adaptive=False, tau_accept=0.9, tau_escalate=0.8)
    options = {"drafter": drafter} if drafting == "assistant" else {"drafter": None, "prompt_lookup_num_tokens": 2}
    ids = prompt_ids.repeat(1, 2) if drafting == "prompt_lookup" else prompt_ids
    out = decode(target, options.pop("drafter"), config, ids, max_new_tokens=64, viasd_check_invariants=True, **options)
    expected = target.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    assert sum(record["probes"] for record in out.viasd_stats.mask_choice["masks"].values()) > 0


def test_a_set_of_one_is_its_mask(target, drafter, prompt_ids):
    mask = two_masks(target).masks["good"]
    config = dict(mode="tiered", adaptive=False, tau_accept=0.9, tau_escalate=0.8)
    single = decode(target, drafter, ViaSDConfig(routing_mask=mask, **config), prompt_ids, max_new_tokens=32)
    as_set = decode(target, drafter, ViaSDConfig(routing_mask=MaskSet({"only": mask}), **config), prompt_ids, max_new_tokens=32)
    assert torch.equal(single.sequences, as_set.sequences) and as_set.viasd_stats.mask_choice is None
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


def test_a_single_mask_saved_over_a_set_leaves_that_mask_alone(target, tmp_path):
    two_masks(target).save_pretrained(tmp_path)
    (tmp_path / "masks" / "notes.txt").write_text("the user's own")
    single = RoutingMask.from_model(target, skip=[2])
    single.save_pretrained(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "masks/notes.txt", "routing_mask.json"]
    assert MaskSet.from_pretrained(tmp_path) == MaskSet({"default": single})


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


# --------------------------------------------------------------------------- the bench: static mask next to the online choice


def test_the_bench_reports_the_mask_chosen_next_to_the_static_mask(target, drafter, single_thread):
    from test_bench import DigitTokenizer

    from viasd_hf.bench.methods import MethodTable
    from viasd_hf.bench.report import mask_markdown
    from viasd_hf.bench.runner import run_methods, summarise
    from viasd_hf.data.tasks import Example

    masks = two_masks(target)
    table = MethodTable(target, drafter, masks.default_mask, None, mask_set=masks)
    with pytest.raises(ValueError, match="viasd_mask_set needs a mask set of two or more masks"):
        MethodTable(target, drafter, masks.default_mask, None).build(["greedy", "viasd_mask_set"])
    methods = table.build(["greedy", "viasd", "viasd_mask_set_nofallback"])  # the chooser runs whatever the timings
    examples = [Example("code", "def add(a, b): return a + b and more"), Example("chat", "hello there general kenobi")]
    runs = run_methods(methods, DigitTokenizer(), examples, max_new_tokens=24)
    summary = summarise(runs, examples, str, {name: 1 for name in methods})
    for task in ("code", "chat"):
        online = summary["viasd_mask_set_nofallback"]["per_task"][task]
        assert sum(online["mask_chosen"].values()) == 1 and "mask_chosen" not in summary["viasd"]["per_task"][task]
    table_text = mask_markdown(summary)
    assert "| viasd_mask_set_nofallback |" in table_text and "greedy" not in table_text


def test_the_mask_table_keeps_decoders_whose_slim_tier_always_runs():
    """``adaptive=False`` (bench ``_nocost``) has no on/off share, yet its slim tier ran: it belongs in the table."""
    from viasd_hf.bench.report import mask_markdown

    work = {"mask_chosen": {"general": 2}, "slim_agreement": 0.5, "escalation_rate": 0.25}
    summary = {
        "greedy": {"per_task": {"qa": {}}},
        "two_tier": {"per_task": {"qa": {}}, "slim_on_fraction": None, "slim_forwards_per_token": 0.0},
        "viasd_mask_set_nocost": {"per_task": {"qa": work}, "slim_on_fraction": None, "slim_forwards_per_token": 0.3},
    }
    table = mask_markdown(summary)
    assert "| viasd_mask_set_nocost | general ×2 · 0.50 · 0.25 |" in table
    assert "two_tier" not in table and "greedy" not in table
