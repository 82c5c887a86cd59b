"""The self-drafter's mask by rule (``viasd_hf.masks.rules``), for a model with no searched mask."""

from __future__ import annotations

import math

import pytest

from tests.conftest import tiny_causal_lm
from viasd_hf.masks.architectures import num_decoder_layers, protected_layers
from viasd_hf.masks.rules import SELF_DRAFT_SKIP_RATIO, rare_kind_layers, rule_layers, rule_mask

RATIOS = (0.1, 0.25, 0.45, 0.6)
SHAPES = {"llama-6": ("llama", {}), "llama-16": ("llama", {"num_hidden_layers": 16}), "gemma3-6": ("gemma3_text", {})}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    return SHAPES[request.param]


@pytest.fixture(scope="module")
def model(shape):
    kind, overrides = shape
    return tiny_causal_lm(kind, **overrides)


@pytest.mark.parametrize("ratio", RATIOS)
def test_the_rule_skips_round_ratio_times_layers_and_never_a_protected_one(model, ratio):
    layers, protected = num_decoder_layers(model), protected_layers(model)
    mask = rule_mask(model, ratio)
    mask.validate_for(model)  # made for this model, no protected layer skipped
    assert not set(mask.skipped_layers) & set(protected)
    k, room = math.floor(ratio * layers + 0.5), layers - len(protected)
    assert len(mask.skipped_layers) == min(k, room)
    assert ratio > 0.45 or k <= room  # up to 0.45 there is room on every tiny model here: exactly k
    assert mask.metadata["rule"] and mask.drafter_id == "self" and mask.skip_ratio == ratio


def test_the_rule_is_deterministic_and_depends_on_the_structure_only(model, shape):
    first = rule_mask(model, SELF_DRAFT_SKIP_RATIO)
    assert rule_mask(model, SELF_DRAFT_SKIP_RATIO).skipped_layers == first.skipped_layers
    kind, overrides = shape
    twin = tiny_causal_lm(kind, seed=7, **overrides)  # the same shape, other weights: the same layers
    assert rule_mask(twin, SELF_DRAFT_SKIP_RATIO).skipped_layers == first.skipped_layers


def test_rule_layers_for_every_stack_size_and_budget():
    for layers in range(2, 65):
        protected = {0, layers // 3, layers - 1}  # the first, one inside (say a first full-attention layer), the last
        skippable = [layer for layer in range(layers) if layer not in protected]
        for k in range(layers + 1):
            skip = rule_layers(layers, protected, k, spared={layers // 2})
            assert skip == sorted(set(skip)) and set(skip) <= set(skippable)
            assert len(skip) == min(k, len(skippable))
            if k > 1:  # a larger budget skips what the smaller one did, and more
                assert set(rule_layers(layers, protected, k - 1, spared={layers // 2})) <= set(skip)


def test_the_rule_starts_in_the_middle_every_other_layer_and_spares_the_ends_and_rare_kinds():
    assert rule_layers(30, {0, 29}, 5) == [11, 13, 15, 17, 19]
    # the next odd layer would be 1: 14 goes first
    assert rule_layers(30, {0, 29}, 14) == [3, 5, 7, 9, 11, 13, 14, 15, 17, 19, 21, 23, 25, 27]
    # Gemma-3-270M: 18 layers, full attention at 5, 11, 17 (5 and 17 protected): 11 is spared
    assert rule_layers(18, {0, 5, 17}, 5, spared={5, 11, 17}) == [3, 7, 9, 13, 15]
    assert rule_layers(18, {0, 5, 17}, 15, spared={5, 11, 17}) == sorted(set(range(18)) - {0, 5, 17})


def test_the_rarer_attention_kind_is_read_from_the_config():
    assert rare_kind_layers(tiny_causal_lm("gemma3_text")) == {2, 5}  # one full-attention layer in three
    assert rare_kind_layers(tiny_causal_lm("llama")) == set()


def test_a_model_with_too_few_layers_skips_what_it_can():
    model = tiny_causal_lm("gemma3_text")  # 6 layers, 0, 2 (first full attention) and 5 protected
    mask = rule_mask(model, 0.9)
    assert mask.skipped_layers == [1, 3, 4]
    mask.validate_for(model)
    assert rule_mask(tiny_causal_lm("llama", num_hidden_layers=2), 0.45).skipped_layers == []


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan")])
def test_a_skip_ratio_outside_zero_to_one_is_refused(model, ratio):
    with pytest.raises(ValueError, match="skip ratio"):
        rule_mask(model, ratio)


def test_the_self_draft_budget_is_a_ratio():
    assert 0.0 < SELF_DRAFT_SKIP_RATIO < 1.0
