"""Masks on the Hub, driven through the real huggingface_hub client against the in-memory Hub of hub_server.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub, serve
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from conftest import tiny_causal_lm
from viasd_hf import MaskSet, RoutingMask, RoutingMaskError, ViaSDConfig, routed, viasd_generate
from viasd_hf.cli import main
from viasd_hf.cli.hub import add_hub_commands
from viasd_hf.hub import files as hub_files
from viasd_hf.masks import repo as mask_repo
from viasd_hf.masks.resolver import clear_mask_cache, resolve_mask

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
    monkeypatch.delenv(mask_repo.MASKS_REPO_ENV, raising=False)
    monkeypatch.setattr(mask_repo, "shipped_mask_dir", lambda: tmp_path / "shipped")
    monkeypatch.setattr(hub_files, "_UNREACHABLE", set())  # what this process learnt about endpoints stays in this test
    clear_mask_cache()
    with serve() as server:
        yield server
    clear_mask_cache()


@pytest.fixture(scope="module")
def llama():
    return tiny_causal_lm("llama")


def llama_mask(model, skip=(2, 3), **found_by) -> RoutingMask:
    return RoutingMask.from_model(model, skip=list(skip), objective="R", objective_value=0.125, **found_by)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``viasd ARGV`` in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def use_as_default_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """What HF_ENDPOINT=endpoint does; huggingface_hub reads it once, at import, into these two constants."""
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def mask_requests(fake_hub: FakeHub) -> list[tuple[str, str]]:
    return [request for request in fake_hub.requests if request[1].endswith("/routing_mask.json")]


def test_slugs_keep_zoo_names_and_flatten_hub_ids():
    assert mask_repo.mask_path_in_repo("qwen2.5-coder-1.5b-instruct", "self") == (
        "qwen2.5-coder-1.5b-instruct/model-free/routing_mask.json"
    )
    for self_drafter in ("self-drafter", "self-draft"):  # as generate asks for it, and the folder's own name
        assert mask_repo.mask_path_in_repo("qwen2.5-coder-1.5b-instruct", self_drafter) == (
            "qwen2.5-coder-1.5b-instruct/self-draft/routing_mask.json"
        )
    assert mask_repo.mask_path_in_repo("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct") == (
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

    by_repo = RoutingMask.from_pretrained(REPO, subfolder="tiny-random-llama/model-free", endpoint=fake_hub.url)
    by_pair = RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url)
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    by_default_repo = RoutingMask.from_pretrained(LLAMA, endpoint=fake_hub.url)
    assert by_repo == by_pair == by_default_repo == mask
    elsewhere = llama_mask(llama, skip=[1])
    elsewhere.push_to_hub(REPO, subfolder="experiments/llama-1", endpoint=fake_hub.url)
    assert RoutingMask.from_pretrained(REPO, subfolder="experiments/llama-1", endpoint=fake_hub.url) == elsewhere
    with pytest.raises(ValueError, match="either subfolder= or target_slug="):
        elsewhere.push_to_hub(REPO, subfolder="experiments/llama-1", drafter_slug="x", endpoint=fake_hub.url)
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


def test_the_default_lookup_falls_back_to_the_shipped_masks_then_fails_clearly(fake_hub, llama, tmp_path, monkeypatch):
    llama_mask(llama).push_to_hub(REPO, endpoint=fake_hub.url)
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    qwen = tiny_causal_lm("qwen2")
    pair = ("tiny-random-qwen2", "self")
    with pytest.raises(RoutingMaskError, match="(?s)no routing mask for target 'tiny-random-qwen2'.*no such file"
                                               ".*shipped with viasd_hf: no .*viasd search"):
        RoutingMask.from_pretrained(pair, endpoint=fake_hub.url)

    shipped = RoutingMask.from_model(qwen, skip=[2])
    shipped.save_pretrained(tmp_path / "shipped" / mask_repo.pair_folder(*pair))
    assert RoutingMask.from_pretrained(pair, endpoint=fake_hub.url) == shipped
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, "viasd-test/nope")
    assert RoutingMask.from_pretrained(pair, endpoint=fake_hub.url) == shipped


def test_an_explicit_repo_or_revision_never_falls_back_to_the_shipped_masks(fake_hub, llama, tmp_path, monkeypatch):
    llama_mask(llama, skip=[3]).push_to_hub(REPO, endpoint=fake_hub.url)
    llama_mask(llama, skip=[2]).save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "model-free")
    shipped_qwen = RoutingMask.from_model(tiny_causal_lm("qwen2"), skip=[2])
    shipped_qwen.save_pretrained(tmp_path / "shipped" / "tiny-random-qwen2" / "model-free")
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    only_explicit = "shipped with viasd_hf are only used when neither repo_id nor revision is given"

    with pytest.raises(RoutingMaskError, match=f"(?s)'tiny-random-llama'.*viasd-test/nope.*repository not found.*{only_explicit}"):
        RoutingMask.from_pretrained(LLAMA, repo_id="viasd-test/nope", endpoint=fake_hub.url)
    with pytest.raises(RoutingMaskError, match=f"(?s)revision 'nope' not found.*{only_explicit}"):
        RoutingMask.from_pretrained(LLAMA, revision="nope", endpoint=fake_hub.url)
    with pytest.raises(RoutingMaskError, match=f"(?s)tiny-random-qwen2/model-free/routing_mask.json: no such file.*{only_explicit}"):
        RoutingMask.from_pretrained(("tiny-random-qwen2", "self"), repo_id=REPO, endpoint=fake_hub.url)
    assert RoutingMask.from_pretrained(LLAMA, revision="main", endpoint=fake_hub.url).skipped_layers == [3]

    out = tmp_path / "pulled"
    for options in (["--repo-id", "viasd-test/nope"], ["--revision", "nope"]):
        code, err = run_cli(["pull", "--target", "tiny-random-llama", "--endpoint", fake_hub.url, "--out", str(out), *options])
        assert code == 1
        assert len(err.splitlines()) == 1, err
        assert err.startswith("viasd pull: error: no routing mask for target 'tiny-random-llama' with drafter 'self' "
                              "(looked in Hub repo")
        assert only_explicit in err and not out.exists()
    code, err = run_cli(["pull", "--target", "tiny-random-qwen2", "--endpoint", fake_hub.url, "--out", str(out)])
    assert (code, err) == (0, "") and RoutingMask.from_pretrained(out) == shipped_qwen


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
    mask.save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "model-free")
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    assert RoutingMask.from_pretrained(LLAMA, endpoint=fake_hub.url, local_files_only=True) == mask
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert RoutingMask.from_pretrained(LLAMA) == mask  # the default endpoint: would fail if it were asked
    assert fake_hub.requests == []


def test_model_card_lists_every_pair_and_the_cli_round_trips(fake_hub, llama, tmp_path):
    parser = argparse.ArgumentParser()
    add_hub_commands(parser.add_subparsers())
    llama_mask(llama, metadata={"heldout": {"top1_agreement": 0.8125}, "search_command": "viasd search x"}).push_to_hub(
        REPO, endpoint=fake_hub.url
    )
    folder = tmp_path / "qwen-mask"
    RoutingMask.from_model(tiny_causal_lm("qwen2"), skip=[3], drafter_id="Org/Tiny-Drafter").save_pretrained(folder)
    (folder / mask_repo.SEARCH_LOG_FILENAME).write_text(json.dumps({"iteration": 0}) + "\n")

    args = parser.parse_args(["push", str(folder), "--repo-id", REPO, "--endpoint", fake_hub.url])
    assert args.handler(args) == 0
    files = HfApi(endpoint=fake_hub.url).list_repo_files(REPO)
    assert {"tiny-random-qwen2/org--tiny-drafter/search_log.jsonl", "tiny-random-llama/model-free/routing_mask.json"} <= set(files)
    card = Path(hf_hub_download(REPO, "README.md", endpoint=fake_hub.url)).read_text()
    assert card.startswith("---\nlibrary_name: viasd_hf\ntags:\n")
    assert "[tiny-random-llama](tiny-random-llama/model-free/routing_mask.json) | self | 4 / 6 | 33.3% | R = 0.125" in card
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


def test_masks_under_the_legacy_folder_names_are_still_found(fake_hub, llama, monkeypatch):
    api = HfApi(endpoint=fake_hub.url)
    api.create_repo(REPO)
    legacy_slim, legacy_draft = llama_mask(llama, skip=[2]), llama_mask(llama, skip=[1, 2, 3])
    api.upload_file(path_or_fileobj=legacy_slim.to_json().encode(), path_in_repo="tiny-random-llama/self/routing_mask.json",
                    repo_id=REPO)
    api.upload_file(path_or_fileobj=legacy_draft.to_json().encode(),
                    path_in_repo="tiny-random-llama/self-drafter/routing_mask.json", repo_id=REPO)
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    assert RoutingMask.from_pretrained(LLAMA, endpoint=fake_hub.url) == legacy_slim
    assert RoutingMask.from_pretrained(("tiny-random-llama", "self-draft"), endpoint=fake_hub.url) == legacy_draft

    current = llama_mask(llama, skip=[3])
    current.push_to_hub(REPO, endpoint=fake_hub.url)  # the new name wins once it exists
    assert RoutingMask.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url) == current
    with pytest.raises(RoutingMaskError, match="(?s)tiny-random-qwen2/model-free/routing_mask.json: no such file"
                                               ".*legacy folder self/ of model-free/.*tiny-random-qwen2/self/routing_mask.json"):
        RoutingMask.from_pretrained(("tiny-random-qwen2", "self"), repo_id=REPO, endpoint=fake_hub.url)


def test_a_viasd_config_round_trips_through_the_hub(fake_hub, llama, monkeypatch):
    config = ViaSDConfig.paper(routing_mask=llama_mask(llama), mode="lossless", num_draft_tokens=4)
    commit = config.push_to_hub("viasd-test/config", endpoint=fake_hub.url)
    assert commit.oid in commit
    assert "viasd_config.json" in HfApi(endpoint=fake_hub.url).list_repo_files("viasd-test/config")
    loaded = ViaSDConfig.from_pretrained("viasd-test/config", endpoint=fake_hub.url)
    assert loaded == config and isinstance(loaded.routing_mask, RoutingMask)

    tiered = ViaSDConfig.paper(mode="tiered", tau_accept=0.9, routing_mask="viasd-test/some-mask")
    tiered.push_to_hub("viasd-test/config", subfolder="tiered", endpoint=fake_hub.url, revision="dev")
    assert ViaSDConfig.from_pretrained("viasd-test/config", subfolder="tiered", revision="dev", endpoint=fake_hub.url) == tiered
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = len(fake_hub.requests)
    assert ViaSDConfig.from_pretrained("viasd-test/config", endpoint=fake_hub.url) == config  # the user cache answers
    assert len(fake_hub.requests) == calls


def test_a_missing_or_invalid_viasd_config_is_named(fake_hub, tmp_path):
    with pytest.raises(FileNotFoundError, match="(?s)no ViaSD config at 'viasd-test/nope'.*repository not found"):
        ViaSDConfig.from_pretrained("viasd-test/nope", endpoint=fake_hub.url)
    ViaSDConfig(mode="tiered").push_to_hub("viasd-test/config", endpoint=fake_hub.url)
    with pytest.raises(FileNotFoundError, match="viasd_config.json: no such file"):
        ViaSDConfig.from_pretrained("viasd-test/config", subfolder="elsewhere", endpoint=fake_hub.url)
    (tmp_path / "viasd_config.json").write_text('{"num_draft_tokens": 4, "speed": "max"}')
    with pytest.raises(ValueError, match=r"unknown ViaSDConfig fields \['speed'\]"):
        ViaSDConfig.from_pretrained(tmp_path)
    config = ViaSDConfig(mode="tiered")
    config.knobs.tau_escalate = 0.9  # now above tau_accept: refused before anything is uploaded
    pushes = len(fake_hub.requests)
    with pytest.raises(ValueError, match="tau_accept"):
        config.push_to_hub("viasd-test/other", endpoint=fake_hub.url)
    assert len(fake_hub.requests) == pushes


# --------------------------------------------------------------------------- the default lookup, once


def test_generate_looks_the_default_mask_up_once(fake_hub, monkeypatch):
    model = tiny_causal_lm("llama")
    mask = llama_mask(model)
    mask.push_to_hub(REPO, endpoint=fake_hub.url)
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    use_as_default_endpoint(monkeypatch, fake_hub.url)  # generate uses the default endpoint
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    config = ViaSDConfig.paper(mode="tiered", tau_accept=0.0, tau_escalate=0.0, adaptive=False)

    def generate():
        return model.generate(ids, custom_generate=viasd_generate, viasd_config=config, prompt_lookup_num_tokens=2,
                              max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)

    first = generate()
    asked = len(mask_requests(fake_hub))
    assert asked >= 1 and first.viasd_stats.slim_forwards > 0  # the slim tier ran with the Hub's mask
    for _ in range(4):
        assert torch.equal(generate().sequences, first.sequences)
    assert len(mask_requests(fake_hub)) == asked
    assert resolve_mask(None, model, "self") == mask and len(mask_requests(fake_hub)) == asked

    other = tiny_causal_lm("llama")  # another model is another lookup
    assert resolve_mask(None, other, "self") == mask and len(mask_requests(fake_hub)) > asked


def test_threads_starting_together_look_a_mask_up_once(monkeypatch):
    model, found = tiny_causal_lm("llama"), []
    mask = llama_mask(model)

    def slow_pull(source, **options):
        found.append(source)
        time.sleep(0.05)
        return mask

    monkeypatch.setattr(RoutingMask, "from_pretrained", classmethod(lambda cls, source, **options: slow_pull(source)))
    clear_mask_cache()
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_mask(None, model, "self"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [mask] * 8 and found == [("tiny-random-llama", "self")]
    assert resolve_mask("org/some-masks", model, "self") == mask and resolve_mask("org/some-masks", model, "x") == mask
    assert found == [("tiny-random-llama", "self"), "org/some-masks"]
    clear_mask_cache(model)
    assert resolve_mask(None, model, "self") == mask and len(found) == 3


@pytest.fixture
def unreachable_hub(monkeypatch) -> list[str]:
    """The default endpoint is a closed local port; every attempt to fetch a mask is logged, and a retry loop fails the test."""
    httpx2 = pytest.importorskip("httpx2")
    import huggingface_hub.utils._http as http

    endpoint = "http://127.0.0.1:9"
    use_as_default_endpoint(monkeypatch, endpoint)
    attempts: list[str] = []
    send = httpx2.Client.send

    def counting_send(self, request, *args, **kwargs):
        assert request.url.host == "127.0.0.1", f"a request left the test: {request.url}"
        if str(request.url).startswith(endpoint) and request.url.path.endswith(("/routing_mask.json", "/mask_set.json")):
            attempts.append(f"{request.method} {request.url}")  # (the client may also fetch its own metadata)
        return send(self, request, *args, **kwargs)

    class NoSleep:
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            raise AssertionError(f"the Hub client went into its retry loop ({seconds} s)")

    monkeypatch.setattr(httpx2.Client, "send", counting_send)
    monkeypatch.setattr(http, "time", NoSleep())
    return attempts


def test_an_unreachable_hub_is_asked_once_and_the_shipped_mask_answers(fake_hub, unreachable_hub, tmp_path):
    model = tiny_causal_lm("llama")
    shipped = llama_mask(model, skip=[1])
    shipped.save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "model-free")
    code, err = run_cli(["pull", "--target", "tiny-random-llama", "--repo-id", REPO, "--out", str(tmp_path / "out")])
    assert code == 1 and "not in the local cache, and the Hub was not reachable" in err  # explicit: no fallback, no wait
    for _ in range(3):
        assert resolve_mask(None, model, "self") == shipped
    assert resolve_mask(None, tiny_causal_lm("llama"), "self") == shipped  # a new lookup: the endpoint is not asked again
    assert RoutingMask.from_pretrained(LLAMA) == shipped
    assert len(unreachable_hub) == 1 and unreachable_hub[0].startswith("HEAD ")


def test_an_unreachable_hub_lets_the_user_cache_answer(fake_hub, unreachable_hub, tmp_path, monkeypatch):
    model = tiny_causal_lm("llama")
    cached = llama_mask(model, skip=[4])
    cached.push_to_hub(REPO, endpoint=fake_hub.url)
    monkeypatch.setenv(mask_repo.MASKS_REPO_ENV, REPO)
    assert RoutingMask.from_pretrained(LLAMA, endpoint=fake_hub.url) == cached  # now in the user cache
    llama_mask(model, skip=[1]).save_pretrained(tmp_path / "shipped" / "tiny-random-llama" / "model-free")
    assert resolve_mask(None, model, "self") == cached
    assert resolve_mask(None, tiny_causal_lm("llama"), "self") == cached
    assert len(unreachable_hub) == 1


# --------------------------------------------------------------------------- pushing next to a malformed mask


def test_a_malformed_mask_in_the_repo_does_not_block_later_pushes(fake_hub, llama, caplog):
    api = HfApi(endpoint=fake_hub.url)
    llama_mask(llama).push_to_hub(REPO, endpoint=fake_hub.url)
    good = json.loads(llama_mask(llama).to_json())
    broken = {
        "wrong-type": json.dumps(good | {"num_layers": "six"}).encode(),
        "missing-field": json.dumps({"kept_layers": [0, 5]}).encode(),
        "binary": b"\xff\xfe\x00\x81 not text",
        "a-list": b"[0, 1, 2]",
        "not-json": b"{\"kept_layers\": [0,",
        "objective-text": json.dumps(good | {"objective_value": "high"}).encode(),
    }
    for name, data in broken.items():
        api.upload_file(path_or_fileobj=data, path_in_repo=f"{name}/model-free/routing_mask.json", repo_id=REPO)

    qwen = RoutingMask.from_model(tiny_causal_lm("qwen2"), skip=[3])
    with caplog.at_level(logging.WARNING, logger="viasd_hf.masks.routing_mask"):
        qwen.push_to_hub(REPO, endpoint=fake_hub.url)
    card = Path(hf_hub_download(REPO, "README.md", endpoint=fake_hub.url)).read_text()
    assert "[tiny-random-llama](tiny-random-llama/model-free/routing_mask.json)" in card
    assert "[tiny-random-qwen2](tiny-random-qwen2/model-free/routing_mask.json)" in card
    for name in broken:
        assert f"{name}/model-free" not in card
        assert any(f"leaving {name}/model-free/routing_mask.json out of the model card" in m for m in caplog.messages)
    assert RoutingMask.from_pretrained(("tiny-random-qwen2", "self"), repo_id=REPO, endpoint=fake_hub.url) == qwen


def test_push_publishes_a_mask_set_folder_whole(fake_hub, llama, tmp_path):
    masks = MaskSet({"general": llama_mask(llama), "code": llama_mask(llama, skip=[1])})
    folder = tmp_path / "set"
    masks.save_pretrained(folder)
    (folder / mask_repo.SEARCH_LOG_FILENAME).write_text(json.dumps({"iteration": 0}) + "\n")
    assert run_cli(["push", str(folder), "--repo-id", REPO, "--endpoint", fake_hub.url]) == (0, "")
    assert MaskSet.from_pretrained(LLAMA, repo_id=REPO, endpoint=fake_hub.url) == masks
    log = hf_hub_download(REPO, "tiny-random-llama/model-free/search_log.jsonl", endpoint=fake_hub.url)
    assert Path(log).read_text() == (folder / mask_repo.SEARCH_LOG_FILENAME).read_text()

    member = folder / "masks" / "code.json"
    member.write_text(member.read_text().replace('"target_id": "tiny-random-llama"', '"target_id": ""'))
    requests = len(fake_hub.requests)
    code, err = run_cli(["push", str(folder), "--repo-id", REPO, "--endpoint", fake_hub.url])
    assert code == 2 and err.startswith(f"viasd push: error: MASK_DIR {folder}: not a valid routing mask: mask set member "
                                        "'code': the routing mask lacks the target's id"), err
    assert len(fake_hub.requests) == requests


def test_pull_writes_a_pushed_mask_set_whole_and_drops_a_stale_one(fake_hub, llama, tmp_path, capsys):
    masks = MaskSet({"general": llama_mask(llama), "code": llama_mask(llama, skip=[1])})
    masks.push_to_hub(REPO, endpoint=fake_hub.url)
    out = tmp_path / "pulled"
    old = MaskSet({"general": llama_mask(llama), "math": llama_mask(llama, skip=[2]), "chat": llama_mask(llama, skip=[4])})
    old.save_pretrained(out)  # a set pulled before, with members the new one lacks
    assert main(["pull", "--target", "tiny-random-llama", "--endpoint", fake_hub.url, "--repo-id", REPO, "--out", str(out)]) == 0
    assert MaskSet.from_pretrained(out) == masks
    assert sorted(p.name for p in (out / "masks").iterdir()) == ["code.json"]
    said = capsys.readouterr().out
    assert "a mask set of 2 masks for tiny-random-llama (default 'general')" in said and "'code' keeps" in said

    RoutingMask.from_model(llama, skip=[2]).push_to_hub(REPO, endpoint=fake_hub.url)  # a lone mask replaces the set
    assert run_cli(["pull", "--target", "tiny-random-llama", "--endpoint", fake_hub.url, "--repo-id", REPO, "--out", str(out)]) == (0, "")
    assert not (out / mask_repo.MASK_SET_FILENAME).exists() and not (out / "masks").exists()
    assert MaskSet.from_pretrained(out).masks == {"default": RoutingMask.from_model(llama, skip=[2])}


# --------------------------------------------------------------------------- `viasd push` and `viasd pull` arguments


def test_push_and_pull_report_bad_arguments_in_one_line_before_any_request(fake_hub, llama, tmp_path):
    folder = tmp_path / "mask"
    llama_mask(llama).save_pretrained(folder)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "routing_mask.json").write_bytes(b"\xff\xfe binary")
    (tmp_path / "a-file").write_text("")
    url = ["--endpoint", fake_hub.url]
    cases = {
        ("push", str(tmp_path / "nope"), "--repo-id", REPO, *url): f"viasd push: error: MASK_DIR {tmp_path / 'nope'}: no such folder or file",
        ("push", str(tmp_path / "bad"), "--repo-id", REPO, *url): f"viasd push: error: MASK_DIR {tmp_path / 'bad'}: not a valid routing mask: ",
        ("push", str(folder), "--repo-id", "not a repo", *url): "viasd push: error: --repo-id not a repo: not a Hub repo id (",
        ("push", str(folder), "--repo-id", REPO, "--endpoint", "localhost:8080"): "viasd push: error: --endpoint localhost:8080: not an http(s) URL",
        ("pull", "--target", "tiny-random-llama", "--out", str(tmp_path / "a-file"), *url): f"viasd pull: error: --out {tmp_path / 'a-file'}: exists and is not a folder",
        ("pull", "--target", "tiny-random-llama", "--out", str(tmp_path / "a-file" / "x"), *url): f"viasd pull: error: --out {tmp_path / 'a-file' / 'x'}: {tmp_path / 'a-file'} is a file, so no folder can be made there",
        ("pull", "--target", "/", "--out", str(tmp_path / "o"), *url): "viasd pull: error: --target must name a model",
        ("pull", "--target", "x", "--repo-id", "a/b/c", "--out", str(tmp_path / "o"), *url): "viasd pull: error: --repo-id a/b/c: not a Hub repo id (",
    }
    for argv, message in cases.items():
        code, err = run_cli(list(argv))
        assert code == 2, (argv, err)
        assert len(err.splitlines()) == 1 and err.startswith(message), (argv, err)
    assert fake_hub.requests == []


def test_push_to_an_unreachable_hub_is_one_line(tmp_path, llama, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test_hub")
    llama_mask(llama).save_pretrained(tmp_path / "mask")
    code, err = run_cli(["push", str(tmp_path / "mask"), "--repo-id", REPO, "--endpoint", "http://127.0.0.1:9"])
    assert code == 1 and err.startswith("viasd push: error: the Hub at http://127.0.0.1:9 did not answer: ")
    assert len(err.splitlines()) == 1


def test_a_model_without_a_name_is_not_looked_up_on_the_hub(fake_hub, monkeypatch, speculating):
    """A model built from a config has no name: its pair's mask cannot be looked up (a clear error, the Hub
    not asked), and the default ``vocabulary="auto"`` decodes over the whole vocabulary instead of failing."""
    use_as_default_endpoint(monkeypatch, fake_hub.url)
    model = tiny_causal_lm("llama")
    model.config._name_or_path = ""
    with pytest.raises(RoutingMaskError, match="has no name"):
        resolve_mask(None, model, "self")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    config = ViaSDConfig(routing_mask=llama_mask(model))
    out = model.generate(ids, custom_generate=viasd_generate, viasd_config=config, prompt_lookup_num_tokens=2,
                         max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert out.viasd_stats.drafted_tokens > 0
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert not fake_hub.requests
