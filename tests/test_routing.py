"""The routed slim verifier skips layers for real, matches a model built without them, and restores exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from conftest import TINY_CONFIGS, tiny_causal_lm, tiny_t5, without_layers
from viasd_hf import RoutingMask, RoutingMaskError, routed
from viasd_hf.masks.architectures import decoder_layers, protected_layers

SKIPS = {"llama": [1, 3], "mistral": [2, 4], "qwen2": [1, 4], "qwen3": [3], "gemma3_text": [1, 3, 4]}


def count_submodule_calls(layer: torch.nn.Module) -> list[int]:
    """Register pre-hooks on every submodule of ``layer``; the returned counter grows when any of them runs."""
    calls = [0]
    for module in layer.modules():
        if module is not layer:
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_routed_forward_equals_model_without_those_layers(kind, prompt_ids):
    model = tiny_causal_lm(kind)
    skip = SKIPS[kind]
    mask = RoutingMask.from_model(model, skip=skip)
    with torch.no_grad(), routed(model, mask):
        slim = model(prompt_ids, use_cache=False).logits
    reference = without_layers(model, skip)(prompt_ids, use_cache=False).logits
    torch.testing.assert_close(slim, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_skipped_layers_do_not_execute_and_write_no_cache(kind, prompt_ids):
    model = tiny_causal_lm(kind)
    skip = SKIPS[kind]
    layers = decoder_layers(model)
    calls = {i: count_submodule_calls(layers[i]) for i in range(len(layers))}
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), routed(model, RoutingMask.from_model(model, skip=skip)):
        model(prompt_ids, cache=cache, use_cache=True)
    for index, counter in calls.items():
        assert (counter[0] == 0) == (index in skip), f"layer {index} ran={counter[0]}"
        written = cache.layers[index].get_seq_length() if index < len(cache.layers) else 0
        assert (written == 0) == (index in skip), f"layer {index} cache length {written}"


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_model_is_restored_bitwise_after_routing(kind, prompt_ids):
    model = tiny_causal_lm(kind)
    with torch.no_grad():
        before = model(prompt_ids).logits
        with routed(model, RoutingMask.from_model(model, skip=SKIPS[kind])):
            slim = model(prompt_ids).logits
        after = model(prompt_ids).logits
    assert not torch.equal(before, slim)
    assert torch.equal(before, after)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_model_is_restored_when_the_block_raises(prompt_ids):
    model = tiny_causal_lm("llama")
    with pytest.raises(RuntimeError, match="boom"), routed(model, RoutingMask.from_model(model, skip=[2])):
        raise RuntimeError("boom")
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_gemma_soft_capping_still_applies_on_the_slim_path(prompt_ids):
    model = tiny_causal_lm("gemma3_text")
    cap = model.config.final_logit_softcapping
    with torch.no_grad(), routed(model, RoutingMask.from_model(model, skip=SKIPS["gemma3_text"])):
        logits = model(prompt_ids).logits
    assert logits.abs().max() < cap
    assert logits.abs().max() > 0.5 * cap


def test_t5_decoder_blocks_are_skipped_and_match_reference(prompt_ids):
    model = tiny_t5()
    skip = [2, 4]
    decoder_ids = prompt_ids[:, :7]
    blocks = decoder_layers(model)
    with torch.no_grad():
        before = model(input_ids=prompt_ids, decoder_input_ids=decoder_ids).logits
        calls = {i: count_submodule_calls(blocks[i]) for i in range(len(blocks))}
        with routed(model, RoutingMask.from_model(model, skip=skip)):
            slim = model(input_ids=prompt_ids, decoder_input_ids=decoder_ids).logits
        not_run = [i for i, counter in calls.items() if counter[0] == 0]
        after = model(input_ids=prompt_ids, decoder_input_ids=decoder_ids).logits
        reference = without_layers(model, skip)(input_ids=prompt_ids, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(slim, reference, atol=1e-5, rtol=0)
    assert torch.equal(before, after)
    assert not_run == skip


def test_protected_layers_of_gemma3_include_first_full_and_sliding_layers():
    model = tiny_causal_lm("gemma3_text")
    assert sorted(protected_layers(model)) == [0, 2, 5]


@pytest.mark.parametrize(("kind", "layer", "named"), [
    ("llama", 0, "first layer"),
    ("llama", 5, "last layer"),
    ("gemma3_text", 2, "first full-attention layer"),
])
def test_masks_that_skip_a_protected_layer_are_refused(kind, layer, named):
    model = tiny_causal_lm(kind)
    with pytest.raises(RoutingMaskError, match=f"layer {layer}.*{named}"):
        RoutingMask.from_model(model, skip=[layer])


def test_mask_for_another_model_refuses_to_apply():
    llama = tiny_causal_lm("llama")
    mask = RoutingMask.from_model(llama, skip=[2])
    with pytest.raises(RoutingMaskError, match="fingerprint"):
        with routed(tiny_causal_lm("qwen2"), mask):
            pass


def test_mask_with_wrong_layer_count_refuses_to_apply():
    mask = RoutingMask.from_model(tiny_causal_lm("llama"), skip=[2])
    mask.num_layers, mask.kept_layers = 8, mask.kept_layers + [6, 7]
    with pytest.raises(RoutingMaskError, match="8-layer model.*6 decoder layers"):
        mask.validate_for(tiny_causal_lm("llama"))


def test_skipping_a_layer_the_model_does_not_have_is_refused():
    with pytest.raises(RoutingMaskError, match=r"cannot skip layers \[9\]"):
        RoutingMask.from_model(tiny_causal_lm("llama"), skip=[9])


def test_a_decoder_with_two_layer_lists_side_by_side_is_refused_naming_them():
    from viasd_hf import UnsupportedArchitectureError

    model = tiny_causal_lm("llama")
    model.model.adapters = nn.ModuleList([nn.Linear(4, 4)])
    with pytest.raises(UnsupportedArchitectureError, match="2 layer lists side by side .*layers, adapters"):
        RoutingMask.from_model(model, skip=[1])
