"""The runner-up branch (``viasd_hf.engine.branching``): a leaf beside the draft in the full pass, exact in greedy decoding."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, assert_stats_consistent, near_copy, rounding_tolerance, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, viasd_generate
from viasd_hf.engine.branching import RunnerUp, can_branch, keep_leaf, leaf_inputs, runner_up
from viasd_hf.engine.kv_cache import new_cache

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def distribution(**probs: float) -> torch.Tensor:
    """A distribution over 8 tokens named t0..t7, the rest of the mass spread evenly."""
    values = torch.zeros(8)
    for name, p in probs.items():
        values[int(name[1:])] = p
    rest = values == 0
    values[rest] = (1 - values.sum()) / rest.sum()
    return values


def test_the_runner_up_goes_where_the_drafter_rates_it_likeliest_to_be_needed():
    sure, torn = distribution(t1=0.9, t2=0.05), distribution(t3=0.5, t4=0.4)
    assert runner_up([1, 3], [sure, torn]) == RunnerUp(1, 4)  # 0.9 · 0.4 beats 0.05 at position 0
    assert runner_up([3, 1], [torn, sure]) == RunnerUp(0, 4)
    assert runner_up([1, 1], [sure, sure]) is None, "a runner-up of 0.05 is not worth the row"
    assert runner_up([1, 1], [sure, sure], min_chance=0.01) == RunnerUp(0, 2)
    off_top = distribution(t5=0.6, t6=0.3)
    assert runner_up([6], [off_top]) == RunnerUp(0, 5), "a draft that is not the top token: the top one is the other choice"
    assert runner_up([6, 1], [None, sure], min_chance=0.0) is None, "a copied draft has no runner-up"


def test_a_leaf_is_worth_its_row_when_it_is_likely_enough_and_rows_are_cheap():
    from viasd_hf.control.draft_planner import DraftPlanner, StaticCosts

    cheap_rows, dear_rows = (DraftPlanner(StaticCosts(drafter=0.2, per_token=b), longest=10) for b in (0.01, 0.2))
    assert cheap_rows.leaf_threshold([0.9, 0.5]) < dear_rows.leaf_threshold([0.9, 0.5])
    assert cheap_rows.leaf_threshold([0.9, 0.5]) < 0.05 < dear_rows.leaf_threshold([0.9, 0.5])
    assert DraftPlanner(StaticCosts(drafter=0.2, per_token=0.0), longest=10).leaf_threshold([0.5]) == 0.0


def test_a_leaf_sees_the_prefix_and_the_draft_before_it_at_its_own_position():
    model = tiny_causal_lm("llama")
    layout = leaf_inputs(model, cached=3, fed=5, leaf_at=2, device=torch.device("cpu"))
    mask = layout["attention_mask"][0, 0]
    assert mask.shape == (5, 8)
    assert torch.equal(mask[:4], torch.ones(4, 8, dtype=torch.bool).tril(diagonal=3)[:4])
    assert mask[4].tolist() == [True] * 5 + [False, False, True]
    assert layout["position_ids"].tolist() == [[3, 4, 5, 6, 5]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_pass_with_a_leaf_scores_the_draft_and_the_branch_as_separate_passes_would(attention):
    model = tiny_causal_lm("qwen2", dtype=torch.float64, attn_implementation=attention)
    prefix, draft, leaf = torch.tensor([[5, 9, 11, 2]]), [7, 8, 9], 40
    branch_ids = torch.cat([prefix, torch.tensor([draft[:1] + [leaf]])], dim=-1)
    with torch.no_grad():
        chain = model(torch.cat([prefix, torch.tensor([draft])], dim=-1)).logits[0, -4:]
        branch = model(branch_ids).logits[0, -1]
        cache = new_cache(model.config)
        model(prefix[:, :-1], cache=cache, use_cache=True)
        fed = torch.cat([prefix[:, -1:], torch.tensor([draft + [leaf]])], dim=-1)
        layout = leaf_inputs(model, cached=3, fed=5, leaf_at=2, device=fed.device)
        both = model(fed, cache=cache, use_cache=True, **layout).logits[0]
    # transformers' eager attention takes its softmax in float32; the sums through every layer bound the rest
    precision = torch.float32 if attention == "eager" else torch.float64
    terms = model.config.num_hidden_layers * model.config.intermediate_size

    def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
        return torch.allclose(actual, expected, rtol=0, atol=rounding_tolerance(precision, terms, expected.abs().max()))

    assert close(both[:4], chain) and close(both[4], branch)

    keep_leaf(cache, length=5, leaf_index=7)  # the prefix, draft[0], then the leaf
    reference = new_cache(model.config)
    with torch.no_grad():
        model(branch_ids, cache=reference, use_cache=True)
    for kept, expected in zip(cache.layers, reference.layers):
        assert close(kept.keys, expected.keys) and close(kept.values, expected.values)


def test_branching_needs_a_mask_the_model_honours():
    llama = tiny_causal_lm("llama")
    assert can_branch(llama, new_cache(llama.config), padded=False)
    assert not can_branch(llama, new_cache(llama.config), padded=True)
    gemma = tiny_causal_lm("gemma3_text")
    assert not can_branch(gemma, new_cache(gemma.config), padded=False), "sliding-window layers"


@pytest.fixture(scope="module")
def pair():
    """A target sure enough of its tokens that its drafter's runner-ups mean something (a random head is flat)."""
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    return target, near_copy(target, scale=0.03)


def decode(target, drafter, ids, **settings):
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless", plain_fallback=False,
                         **settings)
    return target.generate(ids, custom_generate=viasd_generate, viasd_config=config, assistant_model=drafter,
                           max_new_tokens=32, viasd_check_invariants=True, return_dict_in_generate=True,
                           output_scores=True, **GREEDY)


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_output_with_leaves_is_token_identical_to_generate_and_leaves_are_taken(pair, adaptive):
    target, drafter = pair
    taken = 0
    for seed in range(6):
        ids = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(ids, max_new_tokens=32, output_scores=True, return_dict_in_generate=True, **GREEDY)
        # costs from weight sizes, not the wall clock: whether a leaf pays must not hang on the machine's load
        timing = {"tier_switching": "fixed"} if adaptive else {}
        out = decode(target, drafter, ids, adaptive=adaptive, use_slim=False, **timing)
        assert torch.equal(out.sequences, expected.sequences)
        assert all(torch.allclose(a, b, atol=1e-8) for a, b in zip(out.scores, expected.scores))
        assert_stats_consistent(out.viasd_stats, 32, "lossless")
        assert out.viasd_stats.runner_up_blocks > 0
        taken += out.viasd_stats.runner_up_tokens
    assert taken > 0, "no leaf was ever taken: the branch path went untested"


def test_no_leaf_when_sampling_or_switched_off(pair):
    target, drafter = pair
    ids = torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    assert decode(target, drafter, ids, runner_up=False).viasd_stats.runner_up_blocks == 0
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless")
    torch.manual_seed(0)
    out = target.generate(ids, custom_generate=viasd_generate, viasd_config=config, assistant_model=drafter,
                          max_new_tokens=16, do_sample=True, return_dict_in_generate=True, pad_token_id=0)
    assert out.viasd_stats.runner_up_blocks == 0
    with pytest.raises(TypeError, match="runner_up must be True or False"):
        ViaSDConfig(mode="tiered", runner_up=1)


def test_the_runner_up_is_a_bench_lever():
    from viasd_hf.bench.methods import MethodName

    assert MethodName.parse("viasd_lossless_hybrid_norunnerup").ablations == ("_norunnerup",)
