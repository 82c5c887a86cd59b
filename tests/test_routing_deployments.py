"""Routing works on the ways models are really deployed: PEFT LoRA, bitsandbytes 4/8-bit, accelerate offload."""

from __future__ import annotations

import logging

import pytest
import torch
from test_routing import count_submodule_calls
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from conftest import tiny_causal_lm, without_layers
from viasd_hf import RoutingMask, routed
from viasd_hf.masks.architectures import decoder_layers

SKIP = [2, 3]

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def routed_and_plain_logits(model, mask, ids):
    """Logits before, inside and after ``routed``; inside, the skipped layers must not run and a kept one must."""
    layers = decoder_layers(model)
    with torch.no_grad():
        before = model(ids).logits
        calls = {i: count_submodule_calls(layers[i]) for i in range(len(layers))}
        with routed(model, mask):
            slim = model(ids).logits
        ran = {i: counter[0] for i, counter in calls.items()}
        after = model(ids).logits
    assert [i for i, count in ran.items() if count == 0] == mask.skipped_layers
    assert not torch.equal(before, slim), "skipping layers must change the logits"
    return before, slim, after


def test_peft_lora_model(prompt_ids):
    from peft import LoraConfig, get_peft_model

    base = tiny_causal_lm("llama")
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora).eval()
    mask = RoutingMask.from_model(model, skip=SKIP)
    before, slim, after = routed_and_plain_logits(model, mask, prompt_ids)
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    with torch.no_grad():
        reference = without_layers(merged, SKIP)(prompt_ids, use_cache=False).logits
    torch.testing.assert_close(slim, reference, atol=1e-5, rtol=0)
    assert torch.equal(before, after)


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_quantised_model(bits, tmp_path, prompt_ids):
    pytest.importorskip("bitsandbytes")
    full_dir, reduced_dir = tmp_path / "full", tmp_path / "reduced"
    model = tiny_causal_lm("llama", hidden_size=128, intermediate_size=256)  # bitsandbytes' CPU kernels need wide blocks
    model.save_pretrained(full_dir)
    without_layers(model, SKIP).save_pretrained(reduced_dir)
    quantization = BitsAndBytesConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    quantised = AutoModelForCausalLM.from_pretrained(full_dir, quantization_config=quantization, device_map="cpu")
    reference = AutoModelForCausalLM.from_pretrained(reduced_dir, quantization_config=quantization, device_map="cpu")
    mask = RoutingMask.from_model(quantised, skip=SKIP)
    before, slim, after = routed_and_plain_logits(quantised, mask, prompt_ids)
    with torch.no_grad():
        expected = reference(prompt_ids).logits
    torch.testing.assert_close(slim, expected, atol=1e-5, rtol=0)
    assert torch.equal(before, after)


def test_accelerate_disk_offload(tmp_path, prompt_ids):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(6)}
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    offload_forwards = {i: layer.__dict__.get("forward") for i, layer in enumerate(decoder_layers(offloaded))}
    assert offload_forwards[3] is not None, "accelerate should have installed its offload hook"
    mask = RoutingMask.from_model(offloaded, skip=SKIP)
    calls = count_submodule_calls(decoder_layers(offloaded)[3])
    with torch.no_grad(), routed(offloaded, mask):
        slim = offloaded(prompt_ids).logits
    assert calls[0] == 0
    with torch.no_grad():
        after = offloaded(prompt_ids).logits
        reference = without_layers(model, SKIP)(prompt_ids, use_cache=False).logits
        full = model(prompt_ids).logits
    torch.testing.assert_close(slim, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(after, full, atol=1e-5, rtol=0)
    assert {i: layer.__dict__.get("forward") for i, layer in enumerate(decoder_layers(offloaded))} == offload_forwards
