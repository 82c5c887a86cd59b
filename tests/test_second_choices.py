"""The drafter's second choices, verified beside the draft in the full model's pass (``engine.batch.second_choices``):
where the full model's token is the drafter's second choice, the block commits it and the token after it from the
same pass, and greedy output stays token-identical to ``generate``'s, on models of several architectures, alone and in
batches."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_stats_consistent, left_padded, random_prompts, tiny_model_of
from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.second_choices import verifies_beside

pytestmark = pytest.mark.usefixtures("single_thread", "speculating")

GREEDY = {"do_sample": False, "pad_token_id": 0}
WRONG_FIRST = 5  # the token the misled drafter always ranks first


def misled_copy(target: torch.nn.Module) -> torch.nn.Module:
    """The target itself with its first choice displaced: every pass ranks ``WRONG_FIRST`` first, just above the
    target's own choice, so each draft's first token is wrong wherever the target does not want ``WRONG_FIRST``, and
    its second choice, about as likely to the drafter, is the target's."""
    import copy

    drafter = copy.deepcopy(target)

    def ranked_first(module, inputs, output):
        output[..., WRONG_FIRST] = output.max(dim=-1).values + 0.1
        return output

    drafter.get_output_embeddings().register_forward_hook(ranked_first)
    return drafter


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2", "phi3", "gpt2", "olmo2"])
def test_a_second_choice_the_full_model_wants_commits_it_and_the_next_token_and_output_stays_generates(kind, rows):
    target = enable_viasd(tiny_model_of(kind, layers=3))
    prompts = random_prompts(rows, (11, 6, 9)[:rows])
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=misled_copy(target), max_new_tokens=24,
                          viasd_config=ViaSDConfig(use_slim=False, vocabulary=None), viasd_check_invariants=True,
                          return_dict_in_generate=True, **GREEDY)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, viasd_config=None, **GREEDY)
    assert torch.equal(out.sequences, reference)
    stats = out.viasd_stats
    for row in stats.rows:
        assert_stats_consistent(row, row.new_tokens, "lossless", stopped_inside_block=True)
    cache = RaggedCache(target.config, rows, ids.device)
    if not verifies_beside(target, cache, greedy=True):  # one row of a model with sliding windows: its own cache
        assert stats.second_choices == 0
        return
    # each block's first draft is wrong but for the blocks where the target wants WRONG_FIRST; its second choice, the
    # target's token, is kept, and the pass gives the token after it: two tokens a block
    # every block's draft is wrong where the target does not want WRONG_FIRST, and its second choice, the target's
    # token, is kept with the token after it: two tokens a block, but in the first (its pass reads the prompt and
    # verifies no second choice) and where a row's last block is cut short by its length limit
    for row in stats.rows:
        assert row.second_choices_kept >= row.blocks - 2
        assert row.new_tokens >= 2 * row.second_choices_kept


def test_sampling_and_blocks_the_slim_tier_repairs_verify_no_second_choice():
    target = enable_viasd(tiny_model_of("llama", layers=3))
    ids = random_prompts(0, (9,))[0][None]
    drafter = misled_copy(target)
    sampled = target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=True, pad_token_id=0,
                              viasd_config=ViaSDConfig(use_slim=False, vocabulary=None), return_dict_in_generate=True)
    assert sampled.viasd_stats.second_choices == 0
    from viasd_hf import RoutingMask

    repaired = target.generate(ids, assistant_model=drafter, max_new_tokens=12, return_dict_in_generate=True,
                               viasd_config=ViaSDConfig.paper(mode="lossless", adaptive=False, vocabulary=None,
                                                              routing_mask=RoutingMask.from_model(target, skip=[1])),
                               **GREEDY)
    assert repaired.viasd_stats.slim_forwards > 0 and repaired.viasd_stats.second_choices == 0
