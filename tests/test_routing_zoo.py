"""The routed slim verifier on real checkpoints from the offline zoo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_routing import count_submodule_calls

from conftest import without_layers, zoo
from viasd_hf import MaskSet, RoutingMask, RoutingMaskError, ViaSDConfig, enable_viasd, routed
from viasd_hf.masks.architectures import decoder_layers, protected_layers
from viasd_hf.masks.resolver import resolve_slim_masks

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]

PROMPT = "Write a Python function that reverses a string."


def chat_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": PROMPT}]
    if tokenizer.chat_template is None:
        return tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.parametrize(("name", "skip"), [("smollm2-135m-instruct", [3]), ("gemma3-270m", [3, 7, 10])])
def test_routed_real_model_skips_layers_and_matches_reference(name, skip):
    model, tokenizer = zoo(name)
    ids = chat_ids(tokenizer)
    layers = decoder_layers(model)
    mask = RoutingMask.from_model(model, skip=skip)
    with torch.no_grad():
        before = model(ids).logits
        calls = {i: count_submodule_calls(layers[i]) for i in skip + [skip[0] - 1]}
        with routed(model, mask):
            slim = model(ids).logits
        ran = {i: counter[0] for i, counter in calls.items()}
        after = model(ids).logits
        reference = without_layers(model, skip)(ids, use_cache=False).logits
    assert all(ran[i] == 0 for i in skip) and ran[skip[0] - 1] > 0
    torch.testing.assert_close(slim, reference, atol=1e-5, rtol=0)
    assert torch.equal(before, after)
    assert not torch.equal(before, slim)


def test_gemma3_protects_its_first_full_attention_layer():
    model, _ = zoo("gemma3-270m")
    first_full = model.config.layer_types.index("full_attention")
    assert first_full in protected_layers(model)
    with pytest.raises(RoutingMaskError, match=f"layer {first_full}.*full-attention"):
        RoutingMask.from_model(model, skip=[first_full])


def test_smollm2_mask_refuses_gemma3():
    smol, _ = zoo("smollm2-135m-instruct")
    gemma, _ = zoo("gemma3-270m")
    mask = RoutingMask.from_model(smol, skip=[3])
    assert mask.target_id == "smollm2-135m-instruct"
    with pytest.raises(RoutingMaskError, match="30-layer model"):
        mask.validate_for(gemma)


def test_the_shipped_smollm2_mask_set_is_found_for_model_free_drafting_and_decodes_losslessly():
    """The pair's shipped set (general + family masks) is what ``routing_mask=None`` resolves to."""
    model, tokenizer = zoo("smollm2-135m-instruct")
    masks = resolve_slim_masks(None, model, "self")
    assert isinstance(masks, MaskSet) and masks.default == "general" and {"chat-qa", "code"} <= set(masks.masks)
    masks.validate_for(model)
    assert masks.default_mask == RoutingMask.from_pretrained(REPO / "hub_masks" / "smollm2-135m-instruct" / "model-free")
    ids = chat_ids(tokenizer)
    enable_viasd(model)
    common = {"max_new_tokens": 24, "do_sample": False, "return_dict_in_generate": True}
    reference = model.generate(ids, **common).sequences
    # adaptive=False: the slim tier, the set's default mask, runs every block
    out = model.generate(ids, viasd_config=ViaSDConfig.paper(mode="lossless", adaptive=False), prompt_lookup_num_tokens=4, **common)
    assert torch.equal(out.sequences, reference)
    assert out.viasd_stats.slim_forwards > 0
