"""Masks on the Hub, driven through the real huggingface_hub client against the in-memory Hub of hub_server.py."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from conftest import tiny_causal_lm
from hub_server import FakeHub, serve
from viasd_hf import RoutingMask, RoutingMaskError, hub, routed

REPO = "viasd-test/routing-masks"
LLAMA = ("tiny-random-llama", "self")


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fresh in-memory Hub; the client is online for it, and its cache, token and the shipped masks live in tmp_path.

    huggingface_hub reads HF_HUB_OFFLINE and its paths once, at import, so the constants are patched.
    """
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test_hub")
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.delenv(hub.MASKS_REPO_ENV, raising=False)
    monkeypatch.setattr(hub, "shipped_mask_dir", lambda: tmp_path / "shipped")
    with serve() as server:
        yield server


@pytest.fixture(scope="module")
def llama():
    return tiny_causal_lm("llama")


def llama_mask(model, skip=(2, 3), **found_by) -> RoutingMask:
    return RoutingMask.from_model(model, skip=list(skip), objective="R", objective_value=0.125, **found_by)


def test_slugs_keep_zoo_names_and_flatten_hub_ids():
    assert hub.mask_path_in_repo("qwen2.5-coder-1.5b-instruct", "self") == (
        "qwen2.5-coder-1.5b-instruct/self/routing_mask.json"
    )
    assert hub.mask_path_in_repo("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct") == (
        "qwen--qwen2.5-coder-1.5b-instruct/qwen--qwen2.5-coder-0.5b-instruct/routing_mask.json"
    )


def test_create_repo_twice_is_a_409_that_still_carries_the_url(fake_hub):
    api = HfApi(endpoint=fake_hub.url)
    url = api.create_repo(REPO)
    assert api.create_repo(REPO, exist_ok=True) == url == f"{fake_hub.url}/{REPO}"
    with pytest.raises(HfHubHTTPError) as raised:
        api.create_repo(REPO)
    assert raised.value.response.status_code == 409
    assert raised.value.response.json()["url"] == url


def test_push_then_pull_by_repo_id_and_by_pair(fake_hub, llama, monkeypatch):
    mask = llama_mask(llama)
    commit = mask.push_to_hub(REPO, endpoint=fake_hub.url, model=llama)
    assert commit.startswith(f"{fake_hub.url}/{REPO}/commit/") and commit.oid in commit

    by_repo = RoutingMask.from_pretrained(REPO, subfolder="tiny-random-llama/self", endpoint=fake_hub.url)
    by_pair = RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url)
    monkeypatch.setenv(hub.MASKS_REPO_ENV, REPO)
    by_default_repo = RoutingMask.from_pretrained(LLAMA, endpoint=fake_hub.url)
    assert by_repo == by_pair == by_default_repo == mask
    with routed(llama, by_pair):
        pass


def test_pull_a_commit_or_a_branch(fake_hub, llama):
    first = llama_mask(llama, skip=[2]).push_to_hub(REPO, endpoint=fake_hub.url)
    llama_mask(llama, skip=[3]).push_to_hub(REPO, endpoint=fake_hub.url)
    llama_mask(llama, skip=[1, 4]).push_to_hub(REPO, endpoint=fake_hub.url, revision="dev")

    def skipped(**kwargs) -> list[int]:
        return RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url, **kwargs).skipped_layers

    assert skipped() == [3]
    assert skipped(revision=first.oid) == [2]
    assert skipped(revision="dev") == [1, 4]
    with pytest.raises(RoutingMaskError, match="revision 'nope' not found"):
        skipped(revision="nope")


def test_unknown_repo_or_path_names_where_it_looked(fake_hub):
    with pytest.raises(RoutingMaskError, match="(?s)no routing mask at 'viasd-test/nope'.*repository not found.*viasd pull"):
        RoutingMask.from_pretrained("viasd-test/nope", endpoint=fake_hub.url)
    with pytest.raises(RoutingMaskError, match="(?s)local path /no/such/mask: no such folder.*not a valid repo id"):
        RoutingMask.from_pretrained("/no/such/mask")


def test_unknown_pair_falls_back_to_the_shipped_masks_then_fails_clearly(fake_hub, llama, tmp_path):
    llama_mask(llama).push_to_hub(REPO, endpoint=fake_hub.url)
    qwen = tiny_causal_lm("qwen2")
    pair = ("tiny-random-qwen2", "self")
    with pytest.raises(RoutingMaskError, match="(?s)no routing mask for target 'tiny-random-qwen2'.*no such file"
                                               ".*masks shipped with viasd_hf.*viasd search"):
        RoutingMask.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url)

    shipped = RoutingMask.from_model(qwen, skip=[2])
    shipped.save_pretrained(tmp_path / "shipped" / hub.pair_folder(*pair))
    assert RoutingMask.from_pretrained(pair, repo_id=REPO, endpoint=fake_hub.url) == shipped
    assert RoutingMask.from_pretrained(pair, repo_id="viasd-test/nope", endpoint=fake_hub.url) == shipped


def test_offline_the_cached_copy_answers(fake_hub, llama, monkeypatch):
    mask = llama_mask(llama)
    mask.push_to_hub(REPO, endpoint=fake_hub.url)
    assert RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url) == mask
    calls = len(fake_hub.requests)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url) == mask
    with pytest.raises(RoutingMaskError, match="not in the local cache"):
        RoutingMask.from_pretrained(("tiny-random-qwen2", "self"), repo_id=REPO, endpoint=fake_hub.url)
    assert len(fake_hub.requests) == calls


def test_shipped_masks_are_read_without_touching_the_network(fake_hub, llama, tmp_path, monkeypatch):
    mask = llama_mask(llama)
    mask.save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "self")
    assert RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url, local_files_only=True) == mask
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert RoutingMask.from_pretrained(LLAMA) == mask  # the default endpoint: would fail if it were asked
    assert fake_hub.requests == []


def test_model_card_lists_every_pair_and_the_cli_round_trips(fake_hub, llama, tmp_path):
    parser = argparse.ArgumentParser()
    hub.add_hub_commands(parser.add_subparsers())
    llama_mask(llama, metadata={"heldout": {"top1_agreement": 0.8125}, "search_command": "viasd search x"}).push_to_hub(
        REPO, endpoint=fake_hub.url
    )
    folder = tmp_path / "qwen-mask"
    RoutingMask.from_model(tiny_causal_lm("qwen2"), skip=[3], drafter_id="Org/Tiny-Drafter").save_pretrained(folder)
    (folder / hub.SEARCH_LOG_FILENAME).write_text(json.dumps({"iteration": 0}) + "\n")

    args = parser.parse_args(["push", str(folder), "--repo-id", REPO, "--endpoint", fake_hub.url])
    assert args.handler(args) == 0
    files = HfApi(endpoint=fake_hub.url).list_repo_files(REPO)
    assert {"tiny-random-qwen2/org--tiny-drafter/search_log.jsonl", "tiny-random-llama/self/routing_mask.json"} <= set(files)
    card = Path(hf_hub_download(REPO, "README.md", endpoint=fake_hub.url)).read_text()
    assert card.startswith("---\nlibrary_name: viasd_hf\ntags:\n")
    assert "[tiny-random-llama](tiny-random-llama/self/routing_mask.json) | self | 4 / 6 | 33.3% | R = 0.125" in card
    assert "top1_agreement: 0.8125 | `viasd search x` |" in card
    assert "[tiny-random-qwen2](tiny-random-qwen2/org--tiny-drafter/routing_mask.json) | Org/Tiny-Drafter" in card

    args = parser.parse_args(["pull", "--target", "tiny-random-qwen2", "--drafter", "Org/Tiny-Drafter",
                              "--repo-id", REPO, "--endpoint", fake_hub.url, "--out", str(tmp_path / "pulled")])
    assert args.handler(args) == 0
    assert RoutingMask.from_pretrained(tmp_path / "pulled") == RoutingMask.from_pretrained(folder)

    RoutingMask.from_pretrained(folder).push_to_hub(REPO, endpoint=fake_hub.url)  # no search log this time
    assert "tiny-random-qwen2/org--tiny-drafter/search_log.jsonl" not in HfApi(endpoint=fake_hub.url).list_repo_files(REPO)


def test_pushing_an_invalid_mask_is_refused(fake_hub, llama):
    mask = llama_mask(llama)
    with pytest.raises(RoutingMaskError, match="fingerprint"):
        mask.push_to_hub(REPO, endpoint=fake_hub.url, model=tiny_causal_lm("qwen2"))
    mask.kept_layers.append(9)
    with pytest.raises(RoutingMaskError, match=r"kept_layers \[9\] are outside"):
        mask.push_to_hub(REPO, endpoint=fake_hub.url)
    mask = llama_mask(llama)
    mask.target_fingerprint = ""
    with pytest.raises(RoutingMaskError, match="lacks the target's id or config fingerprint"):
        mask.push_to_hub(REPO, endpoint=fake_hub.url)
    assert fake_hub.repos == {}


def test_a_pulled_mask_for_another_model_refuses_to_apply(fake_hub, llama):
    llama_mask(llama).push_to_hub(REPO, endpoint=fake_hub.url)
    pulled = RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url)
    with pytest.raises(RoutingMaskError, match="fingerprint"), routed(tiny_causal_lm("qwen2"), pulled):
        pass
    with pytest.raises(RoutingMaskError, match="6-layer model.*8 decoder layers"):
        pulled.validate_for(tiny_causal_lm("llama", num_hidden_layers=8))
