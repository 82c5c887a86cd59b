"""The prompt costs each model one pass: the drafter's read gives its first draft token, and where the first
block is plain two-tier its full pass processes the prompt too (``BatchedDecoder.open``), as HF assisted
generation's first call does. Tiny random models, float64: exact."""

from __future__ import annotations

import pytest
import torch
from test_decoding import GREEDY, perturbed_copy, prompt, viasd

from conftest import TokensPerCall, assert_stats_consistent, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig
from viasd_hf.control.draft_planner import MeasuredCosts
from viasd_hf.control.tier_controller import TierController


def fresh_pair(kind: str = "llama"):
    """A new target every test: the tier controller and draft planner it remembers start afresh."""
    target = tiny_causal_lm(kind, seed=0, dtype=torch.float64)
    return target, perturbed_copy(target, 0.003, seed=1)


CARRYING = {
    "lossless": dict(mode="lossless"),  # the controller starts with the slim tier off in lossless mode
    "two-tier": dict(mode="lossless", use_slim=False),
    "tiered, slim tier off": dict(mode="tiered", use_slim=False),
}


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])  # gemma3: sliding layers shorter than the prompt
@pytest.mark.parametrize("setting", sorted(CARRYING))
def test_the_first_block_carries_the_prompt_and_decodes_as_generate(kind, setting, speculating):
    target, assistant = fresh_pair(kind)
    ids = prompt(3, length=16)
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[1]), **CARRYING[setting])
    with TokensPerCall(target) as full, TokensPerCall(assistant) as drafter:
        out = viasd(target, ids, config, drafter=assistant)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 24, "lossless" if setting == "lossless" else "tiered")
    assert stats.prefill_forwards == 0 and stats.slim_forwards < stats.blocks  # lossless: the controller probes later
    assert full.calls[0] > ids.shape[1], "one full pass over the prompt and the first draft"
    assert drafter.calls[0] == ids.shape[1], "the drafter's prefill, which gives its first draft token"
    assert stats.drafter_forwards == len(drafter.calls) == stats.drafted_tokens


def test_a_left_padded_prompt_is_carried_with_its_positions():
    target, assistant = fresh_pair()
    ids = torch.cat([torch.zeros((1, 3), dtype=torch.long), prompt(4)], dim=-1)
    attention_mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 10), dtype=torch.long)], dim=-1)
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=20, **GREEDY)
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless")
    out = viasd(target, ids, config, drafter=assistant, attention_mask=attention_mask, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    assert out.viasd_stats.prefill_forwards == 0


def test_the_full_model_prefills_where_the_slim_tier_or_a_self_drafter_reads_its_cache(speculating):
    """Tiered with the slim tier on decides the first block on the slim tier's authority (as the paper has it),
    and a self-drafter drafts on the full model's cache: both need the prompt in it before the first block."""
    target, assistant = fresh_pair()
    ids = prompt(5, length=16)
    mask = RoutingMask.from_model(target, skip=[2])
    for config, extra in (
        (ViaSDConfig.paper(mode="tiered", routing_mask=mask, adaptive=False), {"drafter": assistant}),
        (ViaSDConfig(routing_mask=mask, self_draft_mask=RoutingMask.from_model(target, skip=[1, 2, 3]),
                     mode="lossless", use_slim=False), {}),
    ):
        with TokensPerCall(target) as calls:
            out = viasd(target, ids, config, **extra)
        assert calls.calls[0] == ids.shape[1] - 1 and out.viasd_stats.prefill_forwards == 1


def test_the_carried_block_teaches_the_cost_model_acceptance_but_not_pass_costs(monkeypatch, speculating):
    """Its full pass is mostly the prompt: priced as a verifying pass it would make verification look dear."""
    verified_tokens: list[int] = []
    controller_blocks: list[int] = []
    observe_verifying, observe = MeasuredCosts.observe_verifying, TierController.observe
    monkeypatch.setattr(MeasuredCosts, "observe_verifying",
                        lambda self, seconds, tokens: verified_tokens.append(tokens) or observe_verifying(self, seconds, tokens))
    monkeypatch.setattr(TierController, "observe", lambda self, block: controller_blocks.append(1) or observe(self, block))
    target, assistant = fresh_pair()
    ids = prompt(6, length=40)
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless")
    stats = viasd(target, ids, config, drafter=assistant).viasd_stats
    assert stats.prefill_forwards == 0
    assert len(verified_tokens) == len(controller_blocks) == stats.blocks - 1 - stats.plain_blocks
    assert max(verified_tokens) < ids.shape[1], "no verifying pass was priced with the prompt in it"
    assert sum(stats.accepted_at_position) == stats.accepted_tokens, "the first block's drafts were judged and counted"
