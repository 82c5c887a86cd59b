"""Any decoder a user brings: every architecture below, a tiny random model built from its own config, decodes with
the defaults (``ViaSDConfig()``, no mask published for it) exactly as its own ``generate``; what cannot be routed is
refused, naming why."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import ARCHITECTURES, tiny_model_of
from viasd_hf import RoutingMask, UnsupportedArchitectureError, ViaSDConfig, enable_viasd
from viasd_hf.masks.architectures import decoder_layers, protected_layers
from viasd_hf.masks.resolver import clear_mask_cache
from viasd_hf.masks.routing_mask import MaskNotFoundError

NEW = 20
GREEDY = {"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW, "pad_token_id": 0}
# prompts longer than the tests' sliding windows (6), with n-grams that recur, so prompt lookup copies
PROMPTS = [[5, 9, 14, 23, 5, 9, 14, 31, 40, 5, 9, 14], [7, 8, 61, 7, 8, 62], [33, 12, 50, 33, 12, 70, 33, 12, 80]]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def pair(request):
    """A 6-layer target and a 2-layer assistant of the same architecture."""
    target = enable_viasd(tiny_model_of(request.param))
    return target, tiny_model_of(request.param, layers=2, seed=1)


def plain(target, ids: list[int]) -> torch.Tensor:
    return target.generate(torch.tensor([ids]), viasd_config=None, **GREEDY)[0]


@pytest.mark.parametrize("drafter", ["assistant", "prompt_lookup", "self"])
def test_the_defaults_decode_as_generate(pair, drafter):
    target, assistant = pair
    kwargs = {"assistant": {"assistant_model": assistant}, "prompt_lookup": {"prompt_lookup_num_tokens": 3}}
    ids = torch.tensor([PROMPTS[0]])
    out = target.generate(ids, viasd_config=ViaSDConfig(), return_dict_in_generate=True, **GREEDY,
                          **kwargs.get(drafter, {}))
    assert torch.equal(out.sequences[0], plain(target, PROMPTS[0]))
    assert out.viasd_stats.new_tokens == NEW


@pytest.mark.parametrize("drafter", ["assistant", "prompt_lookup"])
def test_a_left_padded_batch_of_three_gives_each_row_its_own_output(pair, drafter):
    target, assistant = pair
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    kwargs = {"assistant_model": assistant} if drafter == "assistant" else {"prompt_lookup_num_tokens": 3}
    out = target.generate(ids, attention_mask=mask, viasd_config=ViaSDConfig(), **GREEDY, **kwargs)
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(out[row, width - len(prompt):], plain(target, prompt)), f"row {row}"


def test_tiered_mode_runs_with_a_mask_built_from_the_model(pair):
    target, assistant = pair
    middle = [layer for layer in range(1, len(decoder_layers(target))) if layer not in protected_layers(target)]
    mask = RoutingMask.from_model(target, skip=middle[:2])
    out = target.generate(torch.tensor([PROMPTS[0]]), assistant_model=assistant, return_dict_in_generate=True,
                          viasd_config=ViaSDConfig.paper(mode="tiered", routing_mask=mask, adaptive=False), **GREEDY)
    assert out.sequences.shape[1] == len(PROMPTS[0]) + NEW
    assert out.viasd_stats.slim_forwards > 0


def test_skipping_a_layer_is_running_the_model_without_it(pair):
    """The slim verifier's logits are those of the model with the layer removed (a structural check of what a skipped
    layer returns, whatever form the architecture's layers return)."""
    from viasd_hf.masks.layer_skipping import routed

    target, _ = pair
    skip = [layer for layer in range(len(decoder_layers(target))) if layer not in protected_layers(target)][:1]
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        full = target(ids).logits
        with routed(target, RoutingMask.from_model(target, skip=skip)):
            slim = target(ids).logits
        again = target(ids).logits
    assert torch.equal(full, again)
    assert not torch.allclose(full, slim)


def test_a_model_saved_to_the_users_folder_decodes_and_says_once_how_to_find_its_mask(tmp_path, caplog, speculating):
    """No mask is published for a user's own folder: lossless decoding runs without the slim tier and says so once, in
    one line naming the ``viasd search`` command; tiered mode, whose tokens are the slim tier's, refuses."""
    tiny_model_of("llama").save_pretrained(tmp_path / "my-target")
    target = enable_viasd(AutoModelForCausalLM.from_pretrained(tmp_path / "my-target").eval())
    assistant = tiny_model_of("llama", layers=2, seed=1)
    clear_mask_cache()
    with caplog.at_level(logging.WARNING, logger="viasd_hf"):
        for _ in range(2):
            out = target.generate(torch.tensor([PROMPTS[0]]), assistant_model=assistant, viasd_config=ViaSDConfig(),
                                  **GREEDY)
            assert torch.equal(out[0], plain(target, PROMPTS[0]))
    said = [record.getMessage() for record in caplog.records if record.name == "viasd_hf"]
    assert len(said) == 1 and "\n" not in said[0]
    assert f"viasd search --target {tmp_path / 'my-target'} --drafter tiny-random-llama-2" in said[0]
    with pytest.raises(MaskNotFoundError, match="(?s)tiered mode .*viasd search --target"):
        target.generate(torch.tensor([PROMPTS[0]]), assistant_model=assistant, viasd_config=ViaSDConfig(mode="tiered"),
                        **GREEDY)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [("mamba", {}), ("jamba", {"attn_layer_period": 3, "attn_layer_offset": 1}), ("recurrent_gemma", {"head_dim": 8})],
)
def test_layers_with_a_recurrent_state_are_refused_naming_why(kind, fields):
    config = AutoConfig.for_model(kind, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **fields)
    model = enable_viasd(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(UnsupportedArchitectureError, match=f"model_type='{kind}'.* recurrent state"):
        model.generate(torch.tensor([PROMPTS[1]]), viasd_config=ViaSDConfig(), **GREEDY)


def test_viasd_search_on_the_users_folder_saves_the_mask_where_generate_finds_it(tmp_path, monkeypatch):
    """`viasd search --target <folder>` with a budget in minutes, then the next generate for that pair (tiered mode,
    which refuses to run without a mask) finds the mask with no flag."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from viasd_hf.cli import main

    monkeypatch.setenv("VIASD_MASKS_DIR", str(tmp_path / "masks"))
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "my-gemma2"
    tiny_model_of("gemma2").save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w2").save_pretrained(folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(12)) for i in range(8)))
    assert main(["search", "--target", str(folder), "--minutes", "0.5", "--skip-ratio", "0.25", "--iterations", "4",
                 "--prompts", str(prompts), "--num-prompts", "4", "--num-heldout", "2", "--window", "4",
                 "--dtype", "float32"]) == 0
    assert (tmp_path / "masks" / str(folder).strip("/").lower().replace("/", "--") / "model-free").is_dir()
    clear_mask_cache()
    target = enable_viasd(AutoModelForCausalLM.from_pretrained(folder).eval())
    out = target.generate(torch.tensor([PROMPTS[0]]), prompt_lookup_num_tokens=3, return_dict_in_generate=True,
                          viasd_config=ViaSDConfig.paper(mode="tiered", adaptive=False), **GREEDY)
    assert out.viasd_stats.slim_forwards > 0


@pytest.mark.machine_precision
def test_a_users_first_generate_prints_only_the_one_line(tmp_path, monkeypatch, capfd, caplog, speculating):
    """The first call measures the drafter's fastest form here (a minute on a real model) and finds no mask: neither
    prints anything but the one line about the mask (a log record of ``viasd_hf``: stderr unless logging says else)."""
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))  # nothing measured yet
    target, assistant = enable_viasd(tiny_model_of("qwen2")), tiny_model_of("qwen2", layers=2, seed=1)
    clear_mask_cache()
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        target.generate(torch.tensor([PROMPTS[0]]), assistant_model=assistant, viasd_config=ViaSDConfig(), **GREEDY)
    out, err = capfd.readouterr()
    line = ("viasd_hf: tiny-random-qwen2-6: no routing mask, so no slim tier "
            "(`viasd search --target tiny-random-qwen2-6 --drafter tiny-random-qwen2-2` finds one)")
    assert out == "" and set(err.splitlines()) <= {line, ""}
    assert [record.getMessage() for record in caplog.records] == [line]
