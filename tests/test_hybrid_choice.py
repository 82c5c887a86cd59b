"""Hybrid drafting copies a prompt-lookup match only while copying pays (``hybrid_choice.CopyOrDraft``)."""

from __future__ import annotations

import torch

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.control.hybrid_choice import CopyOrDraft


def run_blocks(choice: CopyOrDraft, blocks: int, copied_commits: int, drafted_commits: int, passes: int = 4) -> list[bool]:
    """Blocks that could all copy: copied ones commit ``copied_commits`` tokens, model-drafted ones ``drafted_commits``."""
    copies = []
    for _ in range(blocks):
        copy = choice.copy()
        copies.append(copy)
        choice.observe(copy, copied_commits if copy else drafted_commits, 0 if copy else passes)
    return copies


def test_copying_is_tried_first_and_stays_while_it_commits_more():
    choice = CopyOrDraft(drafter_cost=0.4)
    copies = run_blocks(choice, 200, copied_commits=6, drafted_commits=4)
    assert copies[: choice.explore_every - 1] == [True] * (choice.explore_every - 1)
    assert 200 - 6 <= sum(copies) < 200, "the model drafter is tried now and then, less often as copying keeps winning"


def test_a_first_copy_that_is_thrown_away_gives_way_at_once():
    """A translation: the prompt's n-grams recur, their continuations do not."""
    choice = CopyOrDraft(drafter_cost=0.4)
    copies = run_blocks(choice, choice.explore_every + 1, copied_commits=1, drafted_commits=3)
    assert copies == [True] + [False] * (choice.explore_every - 1) + [True], "one wasted copy, then a try after a while"


def test_copies_that_are_thrown_away_give_way_to_the_model_drafter_but_are_still_tried():
    """One token per copied block (the match was wrong) against four per model block at 2.6 passes' cost."""
    choice = CopyOrDraft(drafter_cost=0.4)
    copies = run_blocks(choice, 400, copied_commits=1, drafted_commits=4)
    assert 1 <= sum(copies[100:]) <= 300 / choice.explore_every, "copying is tried again now and then"


def test_a_costlier_drafter_leaves_more_to_copying():
    """The same yields (2 tokens copied, 4 drafted in 4 passes): a drafter at 0.1 of a verifying pass wins, one at
    0.4 does not."""
    cheap = run_blocks(CopyOrDraft(drafter_cost=0.1), 200, copied_commits=2, drafted_commits=4)
    costly = run_blocks(CopyOrDraft(drafter_cost=0.4), 200, copied_commits=2, drafted_commits=4)
    assert sum(cheap[50:]) < 0.1 * 150 and sum(costly[50:]) > 0.9 * 150


def test_lossless_hybrid_decoding_is_still_greedy_decoding(monkeypatch, speculating):
    target = enable_viasd(tiny_causal_lm("llama", seed=0))
    drafter = tiny_causal_lm("llama", seed=1)
    prompt = torch.tensor([[3, 17, 5, 3, 17, 5, 9, 3, 17]])
    copied = []  # per block the hybrid drafter committed: copied (True) or drafted by the assistant (False)
    observe = CopyOrDraft.observe
    monkeypatch.setattr(CopyOrDraft, "observe", lambda self, copy, *rest: copied.append(copy) or observe(self, copy, *rest))
    greedy = target.generate(prompt, max_new_tokens=40, do_sample=False)
    hybrid = target.generate(prompt, assistant_model=drafter, prompt_lookup_num_tokens=4, max_new_tokens=40,
                             do_sample=False, return_dict_in_generate=True,
                             viasd_config=ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless"))
    assert torch.equal(hybrid.sequences, greedy)
    assert True in copied and False in copied, "blocks of both kinds: copied and drafted by the assistant"
    assert hybrid.viasd_stats.drafted_tokens > hybrid.viasd_stats.drafter_forwards, "copied drafts cost no pass"
