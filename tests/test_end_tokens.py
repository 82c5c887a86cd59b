"""A draft ends at an end token (EOS): nothing drafted after the end of generation could be committed, so drafting
on would only cost drafter passes and verify rows. Tiny random models, float64: exact."""

from __future__ import annotations

import pytest
import torch
from test_decoding import GREEDY, perturbed_copy, prompt
from transformers import GenerationConfig

from conftest import assert_stats_consistent, tiny_causal_lm
from viasd_hf import ViaSDConfig, viasd_generate
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.generation import end_tokens


@pytest.fixture(scope="module")
def pair():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return target, perturbed_copy(target, 0.003, seed=1)


@pytest.mark.parametrize("drafter_is_target", [True, False], ids=["perfect drafter", "assistant"])
def test_a_model_drafter_stops_drafting_at_an_end_token(pair, drafter_is_target):
    target, assistant = pair
    drafter = target if drafter_is_target else assistant
    ids = prompt(2)
    free = target.generate(ids, max_new_tokens=24, **GREEDY)[0, 10:].tolist()
    eos = free[6]
    ends_at = free.index(eos)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    config = ViaSDConfig.paper(mode="tiered", use_slim=False, num_draft_tokens=12, draft_confidence_threshold=None, adaptive=False)
    out = target.generate(ids, custom_generate=viasd_generate, drafter=drafter, viasd_config=config,
                          max_new_tokens=24, do_sample=False, eos_token_id=[eos, 1], pad_token_id=0,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, ends_at + 1, "lossless", stopped_inside_block=True)
    if drafter_is_target:  # every draft is the target's own token: one block, drafted up to the EOS and no further
        assert ends_at + 1 < config.knobs.num_draft_tokens
        assert stats.blocks == 1 and stats.drafted_tokens == ends_at + 1 == stats.drafter_forwards


def test_prompt_lookup_copies_through_the_first_end_token():
    lookup = PromptLookupDrafter(8, end_tokens=frozenset({9}))
    ids = torch.tensor([[4, 5, 6, 9, 7, 8, 4, 5]])
    assert lookup.draft(ids, 8).tokens == [6, 9]
    assert PromptLookupDrafter(8).draft(ids, 8).tokens == [6, 9, 7, 8, 4, 5]


@pytest.mark.parametrize(("eos", "expected"), [(None, set()), (3, {3}), ([3, 7], {3, 7}), (torch.tensor([2]), {2})])
def test_end_tokens_read_every_form_of_eos_token_id(eos, expected):
    assert end_tokens(GenerationConfig(eos_token_id=eos)) == expected
