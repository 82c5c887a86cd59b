"""The routed slim verifier on real checkpoints from the offline zoo."""

from __future__ import annotations

import pytest
import torch

from conftest import zoo, without_layers
from test_routing import count_submodule_calls
from viasd_hf import RoutingMask, RoutingMaskError, routed
from viasd_hf.architectures import decoder_layers, protected_layers

pytestmark = pytest.mark.integration

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
