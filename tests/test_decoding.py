"""Three-tier VIA-SD decoding inside ``generate`` on tiny random models (float64: exact, no near-ties)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache, StoppingCriteria, StoppingCriteriaList

from conftest import (
    VOCAB,
    RecordingStreamer,
    TokensPerCall,
    assert_stats_consistent,
    tiny_causal_lm,
    tiny_t5,
    without_layers,
    work_done,
)
from viasd_hf import RoutingMask, ViaSDConfig, ViaSDGenerationMixin, enable_viasd, viasd_generate
from viasd_hf.control.draft_planner import LONGEST_TWO_TIER_DRAFT, DraftPlanner
from viasd_hf.masks.architectures import returned_form

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def perturbed_copy(model, scale: float, seed: int):
    """A drafter that mostly agrees with ``model``: the same weights plus noise."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    drafter.config._name_or_path = f"{model.config._name_or_path}-drafter"
    return drafter


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Prompt lookup only drafts when n-grams repeat."""
    return prompt(seed, 6).repeat(1, 3)


@pytest.fixture(scope="module")
def pair():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return target, perturbed_copy(target, 0.003, seed=1)


@pytest.fixture(scope="module")
def masks(pair):
    target, _ = pair
    return RoutingMask.from_model(target, skip=[2]), RoutingMask.from_model(target, skip=[1, 2, 3])


def viasd(target, ids, config, max_new_tokens=24, **kwargs):
    return target.generate(
        ids, custom_generate=viasd_generate, viasd_config=config, max_new_tokens=max_new_tokens,
        viasd_check_invariants=True, return_dict_in_generate=True, **GREEDY, **kwargs,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("drafter_kind", ["assistant", "self", "prompt_lookup", "hybrid"])
def test_lossless_greedy_equals_generate_for_every_drafter(pair, masks, seed, drafter_kind):
    target, assistant = pair
    slim, heavy = masks
    ids = repetitive_prompt(seed) if drafter_kind in ("prompt_lookup", "hybrid") else prompt(seed)
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    config = ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, mode="lossless", tau_accept=0.9, tau_escalate=0.2,
                         adaptive=False)
    extra = {"assistant_model": assistant} if drafter_kind in ("assistant", "hybrid") else {}
    extra |= {"prompt_lookup_num_tokens": 4} if drafter_kind in ("prompt_lookup", "hybrid") else {}
    if "assistant_model" in extra:
        extra["drafter"] = extra.pop("assistant_model")
    out = viasd(target, ids, config, **extra)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 24, "lossless")
    if drafter_kind == "hybrid":
        assert stats.drafter_forwards < stats.drafted_tokens, "the lookup drafted where the prompt repeats itself"
    else:
        assert_drafted_and_repaired_with_every_tier(stats, model_drafter=drafter_kind != "prompt_lookup")


def assert_drafted_and_repaired_with_every_tier(stats, model_drafter: bool, accepts: bool = True) -> None:
    """Lossless work: drafts were accepted (fewer full calls than tokens) and the slim tier saw every draft.

    A model drafter drafts in every block that has room for a draft (all but possibly the last), one
    forward per drafted token (an assistant's prefill gives its first); a slim pass (adaptive=False) runs
    on every block that has a draft. ``accepts=False`` where nothing promises that a draft matches
    (prompt lookup on a random model).
    """
    assert stats.decode_full_forwards == stats.new_tokens - stats.accepted_tokens
    if accepts:
        assert stats.accepted_tokens >= 1 and stats.decode_full_forwards < stats.new_tokens
    if model_drafter:
        assert stats.drafter_forwards == stats.drafted_tokens >= stats.blocks - 1
        assert stats.slim_forwards >= stats.blocks - 1
    else:
        assert stats.drafter_forwards == 0 and stats.drafted_tokens > 0
        assert 0 < stats.slim_forwards <= stats.drafted_tokens


def hf_assistant(assistant, num_tokens: int, threshold: float | None):
    """A copy of ``assistant`` set up so HF assisted generation drafts as ``ViaSDConfig.paper(mode="lossless", num_draft_tokens=num_tokens,
    draft_confidence_threshold=threshold, adaptive=False)``: a constant draft length, a fixed confidence threshold."""
    assistant = copy.deepcopy(assistant)
    assistant.generation_config.num_assistant_tokens = num_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0 if threshold is None else threshold  # 0: off
    return assistant


@pytest.mark.parametrize("threshold", [None, 0.4], ids=["no-threshold", "threshold-0.4"])
@pytest.mark.parametrize("seed", range(4))
def test_two_tier_equals_hf_assisted_generation(pair, seed, threshold, monkeypatch):
    """Same tokens and the same work as HF assisted generation: every target call verifies the same draft.

    HF's defaults (transformers 5.24: ``num_assistant_tokens=20``, schedule ``"constant"``,
    ``assistant_confidence_threshold=0.4``, re-fitted on a ROC curve after every block when
    scikit-learn is installed) differ from ViaSDConfig's (5 tokens, a fixed 0.4, a draft length
    that follows acceptance), so both sides are set to one constant schedule. HF only re-fits the
    threshold when scikit-learn is importable; that is turned off so the threshold stays fixed.
    HF reports no statistics, so the target's and the drafter's forward calls are counted on both
    sides: both feed the target the prompt with the first draft in one call, and the drafter's prefill
    gives its first draft token.
    """
    import transformers.generation.candidate_generator as candidate_generator

    monkeypatch.setattr(candidate_generator, "is_sklearn_available", lambda: False)
    target, assistant = pair
    ids = prompt(seed)
    hf_drafter = hf_assistant(assistant, 5, threshold)
    with TokensPerCall(target) as hf_target, TokensPerCall(hf_drafter) as hf_drafts:
        expected = target.generate(ids, assistant_model=hf_drafter, max_new_tokens=24, **GREEDY)
    config = ViaSDConfig.paper(mode="tiered", use_slim=False, num_draft_tokens=5, draft_confidence_threshold=threshold, adaptive=False)
    with TokensPerCall(target) as ours, TokensPerCall(assistant) as our_drafts:
        out = viasd(target, ids, config, drafter=assistant)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 24, "lossless")
    assert stats.slim_forwards == 0
    assert stats.prefill_forwards == 0 and ours.calls[0] > ids.shape[1]
    assert ours.calls == hf_target.calls, "each target call verifies the same draft, the first with the prompt"
    hf_drafted = hf_target.calls[0] - ids.shape[1] + sum(fed - 1 for fed in hf_target.calls[1:])
    assert stats.drafted_tokens == hf_drafted
    assert stats.accepted_tokens == 24 - len(hf_target.calls) > 0
    assert stats.decode_full_forwards == len(hf_target.calls)
    assert our_drafts.calls[0] == hf_drafts.calls[0] == ids.shape[1], "the drafter's prefill gives its first draft token"
    assert len(our_drafts.calls) == len(hf_drafts.calls) == stats.drafter_forwards == stats.drafted_tokens, (
        "one drafter call per draft token")


@pytest.mark.parametrize("seed", range(4))
def test_cascade_without_lenience_is_plain_speculative_decoding(pair, seed):
    target, assistant = pair
    ids = prompt(seed)
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(mode="tiered", use_slim=False, cascade_lenience=0.0, adaptive=False), drafter=assistant)
    assert torch.equal(out.sequences, expected)
    plain = viasd(target, ids, ViaSDConfig.paper(mode="tiered", use_slim=False, adaptive=False), drafter=assistant)
    assert work_done(out.viasd_stats) == work_done(plain.viasd_stats), "α = 0 keeps exactly the drafts plain SD keeps"
    assert_stats_consistent(out.viasd_stats, 24, "lossless")
    assert out.viasd_stats.accepted_tokens >= 1 and out.viasd_stats.slim_forwards == 0


@pytest.mark.parametrize("seed", range(4))
def test_cascade_keeps_only_tokens_within_its_lenience(seed):
    """Every committed token is the full model's argmax or within a factor 1 − α of it, and some are not the argmax."""
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    assistant = tiny_causal_lm("llama", seed=seed + 10, dtype=torch.float64, num_hidden_layers=2)
    ids = prompt(seed)
    out = viasd(target, ids, ViaSDConfig.paper(mode="tiered", use_slim=False, cascade_lenience=0.5), drafter=assistant)
    with torch.no_grad():
        probs = target(out.sequences).logits[0, ids.shape[1] - 1 : -1].softmax(-1)
    committed = out.sequences[0, ids.shape[1] :]
    ratios = probs.gather(-1, committed[:, None])[:, 0] / probs.max(-1).values
    assert bool((ratios > 0.5 - 1e-9).all())
    assert bool((ratios < 1).any()), "the lenient rule must have kept some non-argmax draft"
    assert out.viasd_stats.accepted_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_tiered_with_unit_thresholds_equals_lossless(pair, masks, seed):
    target, assistant = pair
    ids = prompt(seed)
    tiered = viasd(target, ids, ViaSDConfig.paper(mode="tiered", routing_mask=masks[0], tau_accept=1.0, tau_escalate=1.0, adaptive=False),
                   drafter=assistant)
    lossless = viasd(target, ids, ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant)
    assert torch.equal(tiered.sequences, lossless.sequences)
    stats = tiered.viasd_stats
    assert_stats_consistent(stats, 24, "tiered")
    assert stats.slim_accepted_tokens == stats.slim_committed_tokens == 0
    assert stats.slim_forwards == stats.escalated_blocks >= stats.blocks - 1, "the slim tier saw and escalated every draft"
    # once escalated, the full model verifies the drafter's own block: the same work as two-tier decoding
    two_tier = viasd(target, ids, ViaSDConfig.paper(mode="tiered", use_slim=False, adaptive=False), drafter=assistant).viasd_stats
    for count in ("blocks", "drafted_tokens", "accepted_tokens", "decode_full_forwards", "drafter_forwards"):
        assert getattr(stats, count) == getattr(two_tier, count), count
    assert stats.accepted_tokens >= 1


@pytest.mark.parametrize("seed", range(4))
def test_tiered_paper_preset_stats_add_up(pair, masks, seed):
    target, assistant = pair
    out = viasd(target, prompt(seed), ViaSDConfig.paper(routing_mask=masks[0], adaptive=False), drafter=assistant,
                max_new_tokens=40)
    stats = out.viasd_stats
    assert stats.new_tokens == out.sequences.shape[1] - 10 == 40
    assert stats.new_tokens == stats.accepted_tokens + stats.slim_tokens + stats.full_tokens
    assert stats.committed_by == {"drafter": stats.accepted_tokens, "slim": stats.slim_tokens, "full": stats.full_tokens}
    assert stats.drafted_tokens == sum(stats.drafted_at_position)
    assert stats.accepted_tokens == sum(stats.accepted_at_position)
    assert stats.slim_accepted_tokens > 0
    assert stats.slim_forwards <= stats.blocks - stats.catch_up_blocks
    blocks_without_slim = stats.blocks - stats.slim_forwards
    assert stats.full_forwards == stats.prefill_forwards + stats.escalated_blocks + blocks_without_slim
    assert 0.0 <= stats.rejection_rate <= 1.0
    assert_stats_consistent(stats, 40, "tiered")
    assert stats.slim_committed_tokens > stats.slim_accepted_tokens > 0 and stats.slim_forwards > stats.escalated_blocks


def test_slim_backlog_is_bounded(pair, masks):
    target, assistant = pair
    config = ViaSDConfig.paper(mode="tiered", routing_mask=masks[0], tau_accept=0.0, tau_escalate=0.0, max_slim_backlog=7, adaptive=False)
    stats = viasd(target, prompt(0), config, drafter=assistant, max_new_tokens=40).viasd_stats
    assert stats.peak_slim_backlog <= 7
    assert stats.catch_up_blocks >= 1
    assert stats.escalated_blocks == 0
    assert_stats_consistent(stats, 40, "tiered")
    # τ = 0: the slim tier accepts every draft it sees; only a catch-up pass (or a last block without room
    # for a draft) brings in the full model
    assert stats.slim_accepted_tokens >= stats.drafted_tokens - config.knobs.num_draft_tokens * stats.decode_full_forwards
    assert stats.decode_full_forwards - stats.catch_up_blocks in (0, 1)
    assert stats.slim_forwards == stats.blocks - stats.decode_full_forwards > 0
    # each catch-up clears a backlog of at most 7 slim-committed tokens; at most 7 may be left at the end
    # (and a last block cut short by max_new_tokens counts its whole block)
    bound = config.knobs.max_slim_backlog
    assert stats.catch_up_blocks >= (stats.slim_committed_tokens - 2 * bound) / bound


def expected_blocks_for_a_perfect_drafter(target, ids, max_new_tokens, num_draft_tokens, threshold):
    """Blocks a drafter identical to the target needs: every draft is accepted, so a block drafts until the
    length cap, the room left, or the drafter's confidence threshold (on the target's own probabilities
    along its greedy continuation) stops it, and commits its draft plus one token."""
    reference = target.generate(ids, max_new_tokens=max_new_tokens, **GREEDY)
    with torch.no_grad():
        logits = target(reference, use_cache=False).logits[0, ids.shape[1] - 1 : -1].float()
    confident = (logits.softmax(-1).max(-1).values >= (threshold or 0.0)).tolist()
    blocks, position = 0, 0
    while position < max_new_tokens:
        drafted = 0
        while drafted < min(num_draft_tokens, max_new_tokens - position - 1):
            drafted += 1
            if not confident[position + drafted - 1]:
                break
        blocks, position = blocks + 1, position + drafted + 1
    return reference, blocks


PERFECT_DRAFTER_TIERS = {
    "two-tier": dict(mode="lossless", use_slim=False),
    "lossless": dict(mode="lossless", tau_accept=0.0, tau_escalate=0.0),  # τ = 0: the slim tier repairs nothing
    "tiered-escalate-all": dict(mode="tiered", tau_accept=1.0, tau_escalate=1.0),  # the slim tier escalates every draft
}


@pytest.mark.parametrize("threshold", [None, 0.4], ids=["no-threshold", "threshold-0.4"])
@pytest.mark.parametrize("tiers", sorted(PERFECT_DRAFTER_TIERS))
def test_a_drafter_that_is_the_target_has_every_draft_accepted(pair, masks, tiers, threshold):
    """The drafter is the target model itself: the full model accepts every draft, so the counts are known exactly."""
    target, _ = pair
    ids = prompt(0)
    reference, blocks = expected_blocks_for_a_perfect_drafter(target, ids, 24, 5, threshold)
    config = ViaSDConfig.paper(routing_mask=masks[0], num_draft_tokens=5, draft_confidence_threshold=threshold, adaptive=False,
                         **PERFECT_DRAFTER_TIERS[tiers])
    out = viasd(target, ids, config, drafter=target)
    assert torch.equal(out.sequences, reference)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 24, "lossless" if tiers == "lossless" else "tiered")
    assert stats.blocks == blocks
    assert stats.accepted_tokens == stats.drafted_tokens == 24 - blocks == stats.drafter_forwards
    assert stats.decode_full_forwards == blocks and stats.full_tokens == blocks
    assert stats.slim_forwards == (0 if tiers == "two-tier" else blocks)
    assert stats.escalated_blocks == (blocks if tiers == "tiered-escalate-all" else 0)


def slim_greedy_reference(model, skip, ids, max_new_tokens):
    """The slim verifier's greedy continuation, built by hand from a copy of ``model`` without the ``skip`` layers.

    As docs/design.md, "The KV cache" has it, the slim verifier reads the full model's committed prefix: here the prompt
    but its last token, which the full model prefills. From there on each token is the slim model's
    argmax over the rest (fed afresh on that prefill cache each step, as the slim pass does while the
    full model never catches up). A one-token prompt has nothing to prefill: the reference is then the
    slim model's own greedy output without a cache.
    """
    slim = without_layers(model, skip)
    sequence = ids.clone()
    prefix = ids.shape[1] - 1
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if prefix == 0:
                logits = slim(sequence, use_cache=False).logits
            else:
                cache = DynamicCache(config=model.config)
                model(ids[:, :prefix], cache=cache, use_cache=True)
                positions = torch.arange(prefix, sequence.shape[1])[None]
                logits = slim(sequence[:, prefix:], cache=cache, use_cache=True, position_ids=positions).logits
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return sequence


TIERED_REFERENCE_SKIPS = {"llama": [2], "qwen2": [1, 4], "gemma3_text": [1, 3, 4]}  # gemma3: sliding layers too


@pytest.mark.parametrize(("kind", "prompt_length"), [
    (kind, length) for kind in sorted(TIERED_REFERENCE_SKIPS) for length in (1, 10)  # gemma3, 1: an unwritten sliding layer
])
def test_tiered_greedy_with_the_slim_model_drafting_is_the_slim_models_greedy_output(kind, prompt_length):
    """τ_esc = 0 (never escalate) and the self-drafter under the routing mask itself: the slim tier accepts
    every draft and adds its own bonus token, so tiered greedy output is the slim model's greedy output and
    the full model runs for the prefill only (the backlog bound is above max_new_tokens: no catch-up)."""
    model = tiny_causal_lm(kind, seed=3, dtype=torch.float64)
    skip = TIERED_REFERENCE_SKIPS[kind]
    mask = RoutingMask.from_model(model, skip=skip)
    ids = prompt(21, prompt_length)
    new_tokens = 24  # blocks of 5 drafts + 1 bonus: no block is left without room to draft
    config = ViaSDConfig.paper(mode="tiered", self_draft_mask=mask, routing_mask=mask, tau_escalate=0.0, num_draft_tokens=5,
                         draft_confidence_threshold=None, adaptive=False, max_slim_backlog=new_tokens + 8)
    out = viasd(model, ids, config, max_new_tokens=new_tokens)
    reference = slim_greedy_reference(model, skip, ids, new_tokens)
    assert torch.equal(out.sequences, reference)
    full_greedy = model.generate(ids, max_new_tokens=new_tokens, **GREEDY)
    assert not torch.equal(reference, full_greedy), "the slim model must decode unlike the full one, or this shows nothing"
    stats = out.viasd_stats
    assert_stats_consistent(stats, new_tokens, "tiered")
    assert stats.full_forwards == stats.prefill_forwards == int(prompt_length > 1)
    assert stats.slim_forwards == stats.blocks == new_tokens // 6
    assert stats.accepted_tokens == stats.slim_accepted_tokens == stats.drafted_tokens == new_tokens - stats.blocks
    assert stats.slim_committed_tokens == new_tokens and stats.escalated_blocks == stats.catch_up_blocks == 0


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_tiered_greedy_regenerating_every_draft_is_the_slim_models_greedy_output(pair, kind):
    """τ_acc = 1, τ_esc = 0: no draft is kept on confidence and none is escalated, so the slim verifier keeps
    only drafts that are its own argmax and replaces the first other one: its own greedy output again. The
    last block has no room for a draft and is decoded by the full model, so that token is left out."""
    model = tiny_causal_lm(kind, seed=3, dtype=torch.float64)
    drafter = perturbed_copy(model, 0.01, seed=5)
    skip = TIERED_REFERENCE_SKIPS[kind]
    ids, new_tokens = prompt(22), 16
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(model, skip=skip), tau_accept=1.0, tau_escalate=0.0,
                         adaptive=False, max_slim_backlog=new_tokens + 8)
    out = viasd(model, ids, config, drafter=drafter, max_new_tokens=new_tokens)
    reference = slim_greedy_reference(model, skip, ids, new_tokens)
    assert torch.equal(out.sequences[:, :-1], reference[:, :-1])
    stats = out.viasd_stats
    assert_stats_consistent(stats, new_tokens, "tiered")
    assert stats.accepted_tokens == stats.slim_accepted_tokens and stats.escalated_blocks == 0
    assert stats.slim_forwards == stats.slim_tokens == stats.blocks - 1
    assert stats.slim_committed_tokens == new_tokens - 1
    assert stats.decode_full_forwards == 1 and stats.blocks == new_tokens - stats.accepted_tokens


def test_stats_count_the_passes_the_model_really_ran(pair, masks):
    """Forward counters are checked against the layers: a slim pass runs the kept layers only, a full pass all of them.

    Layer 2 is skipped by both the slim mask and the self-drafter's; layer 1 by the self-drafter's only.
    """
    target, _ = pair
    slim, heavy = masks
    layers = target.get_decoder().layers
    returned_form(target)  # the one probe of what its layers return runs once per model, not in a call's passes
    for mode in ("tiered", "lossless"):
        config = ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, mode=mode, adaptive=False)
        with TokensPerCall(layers[0].mlp) as first, TokensPerCall(layers[1].mlp) as drafter_skips, \
                TokensPerCall(layers[2].mlp) as both_skip:
            stats = viasd(target, prompt(4), config, max_new_tokens=30).viasd_stats
        assert_stats_consistent(stats, 30, mode)
        assert len(both_skip.calls) == stats.full_forwards
        assert len(drafter_skips.calls) == stats.full_forwards + stats.slim_forwards
        assert len(first.calls) == stats.full_forwards + stats.slim_forwards + stats.drafter_forwards
        assert stats.slim_forwards > 0 and stats.drafter_forwards > 0
        if mode == "tiered":
            assert stats.decode_full_forwards < stats.blocks, "some blocks were committed without the full model"
            assert sum(both_skip.calls) < 9 + 30, "the full model processed fewer tokens than were committed"
        else:
            assert sum(both_skip.calls) >= 9 + 30 - 1


@pytest.mark.parametrize("mode", ["tiered", "lossless"])
def test_streamer_gets_prompt_then_every_committed_token(pair, masks, mode, speculating):
    target, assistant = pair
    ids, streamer = prompt(3), RecordingStreamer()
    config = ViaSDConfig(routing_mask=masks[0], mode=mode)
    out = viasd(target, ids, config, drafter=assistant, viasd_streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out.sequences[0, 10:].tolist()
    assert streamer.ended
    assert_stats_consistent(out.viasd_stats, 24, mode)
    assert len(streamer.chunks) - 1 == out.viasd_stats.new_tokens and out.viasd_stats.accepted_tokens >= 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(pair, masks, max_new_tokens):
    target, assistant = pair
    out = viasd(target, prompt(5), ViaSDConfig.paper(routing_mask=masks[0]), drafter=assistant, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == 10 + max_new_tokens
    assert_stats_consistent(out.viasd_stats, max_new_tokens, "tiered")
    assert out.viasd_stats.drafted_tokens >= min(1, max_new_tokens - 1), "a draft whenever there is room for one"


def test_eos_inside_a_block_stops_there(pair, masks):
    target, assistant = pair
    ids = prompt(2)
    free = target.generate(ids, max_new_tokens=24, **GREEDY)[0, 10:].tolist()
    eos = free[6]
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = target.generate(
        ids, custom_generate=viasd_generate, drafter=assistant, max_new_tokens=24, do_sample=False, eos_token_id=eos,
        pad_token_id=0, viasd_config=ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected)
    assert out.sequences[0, -1].item() == eos and out.sequences.shape[1] == 10 + free.index(eos) + 1
    stats = out.viasd_stats
    assert sum(stats.committed_by.values()) == stats.new_tokens == free.index(eos) + 1
    assert stats.accepted_tokens + stats.full_tokens > stats.new_tokens, "the block went on past the EOS"
    assert_stats_consistent(stats, free.index(eos) + 1, "lossless", stopped_inside_block=True)
    assert stats.slim_forwards == stats.blocks >= 1, "adaptive=False: the slim tier saw every block's draft"


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria_are_honoured_mid_block(pair, masks):
    target, assistant = pair
    out = viasd(target, prompt(1), ViaSDConfig.paper(routing_mask=masks[0]), drafter=assistant,
                stopping_criteria=StoppingCriteriaList([StopAfter(17)]))
    assert out.sequences.shape[1] == 17
    assert_stats_consistent(out.viasd_stats, 7, "tiered", stopped_inside_block=True)
    assert out.viasd_stats.drafted_tokens >= 1


def test_left_padded_prompt_matches_generate(pair, masks):
    target, assistant = pair
    ids = torch.cat([torch.zeros((1, 3), dtype=torch.long), prompt(4)], dim=-1)
    attention_mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 10), dtype=torch.long)], dim=-1)
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=20, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                attention_mask=attention_mask, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    assert_stats_consistent(out.viasd_stats, 20, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=True)


def test_logits_processors_apply_as_in_generate(pair, masks):
    target, assistant = pair
    ids = prompt(6)
    expected = target.generate(ids, max_new_tokens=20, repetition_penalty=1.8, no_repeat_ngram_size=2, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                max_new_tokens=20, repetition_penalty=1.8, no_repeat_ngram_size=2)
    assert torch.equal(out.sequences, expected)
    assert_stats_consistent(out.viasd_stats, 20, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=True)


def test_output_scores_match_generate(pair, masks):
    target, assistant = pair
    ids = prompt(7)
    expected = target.generate(ids, max_new_tokens=12, output_scores=True, return_dict_in_generate=True, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                max_new_tokens=12, output_scores=True)
    assert len(out.scores) == len(expected.scores) == 12
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)
    assert_stats_consistent(out.viasd_stats, 12, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=True)


def test_enable_viasd_routes_viasd_config_and_leaves_plain_generate_alone(masks):
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    assistant = perturbed_copy(target, 0.003, seed=1)
    ids = prompt(8)
    before = target.generate(ids, max_new_tokens=16, **GREEDY)
    with pytest.raises(ValueError, match="viasd_config"):
        target.generate(ids, max_new_tokens=4, viasd_config=ViaSDConfig(mode="tiered", routing_mask=masks[0]), **GREEDY)
    enable_viasd(target)
    assert type(target) is type(assistant)  # the class is left alone
    assert torch.equal(target.generate(ids, max_new_tokens=16, **GREEDY), before)
    config = ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False)
    out = target.generate(ids, assistant_model=assistant, viasd_config=config, max_new_tokens=16,
                          return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, before)
    assert out.viasd_stats.drafter_forwards > 0
    assert_stats_consistent(out.viasd_stats, 16, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=True)


def test_mixin_on_a_model_class(masks):
    from transformers import LlamaForCausalLM

    class ViaSDLlama(ViaSDGenerationMixin, LlamaForCausalLM):
        pass

    plain = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    model = ViaSDLlama(plain.config).to(torch.float64).eval()
    model.load_state_dict(plain.state_dict())
    ids = repetitive_prompt(9)
    out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=12, return_dict_in_generate=True,
                         viasd_config=ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", adaptive=False), **GREEDY)
    assert torch.equal(out.sequences, plain.generate(ids, max_new_tokens=12, **GREEDY))
    assert_stats_consistent(out.viasd_stats, 12, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=False, accepts=False)


def test_clear_errors_for_unsupported_requests(pair, masks):
    target, assistant = pair
    config = ViaSDConfig(mode="tiered", routing_mask=masks[0])
    with pytest.raises(ValueError, match="only supports batch size 1.*batch of 2"):
        viasd(target, torch.cat([prompt(0), prompt(1)]), config, drafter=assistant, viasd_streamer=RecordingStreamer())
    other_vocab = tiny_causal_lm("llama", seed=1, dtype=torch.float64, vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match="shares the target's tokenizer"):
        viasd(target, prompt(0), config, drafter=other_vocab)
    t5 = tiny_t5()
    with pytest.raises(ValueError, match="assistant model for an encoder-decoder target"):
        t5.generate(prompt(0), custom_generate=viasd_generate, viasd_config=ViaSDConfig(mode="tiered"), drafter=tiny_t5(seed=1),
                    max_new_tokens=4)
    with pytest.raises(ValueError, match="tau_accept"):
        ViaSDConfig.paper(mode="tiered", tau_accept=0.3, tau_escalate=0.6)
    with pytest.raises(ValueError, match="mode"):
        ViaSDConfig(mode="fast")


def test_config_round_trips_through_save_pretrained(masks, tmp_path):
    config = ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", num_draft_tokens=4)
    config.save_pretrained(tmp_path)
    loaded = ViaSDConfig.from_pretrained(tmp_path)
    assert loaded == config
    assert isinstance(loaded.routing_mask, RoutingMask)


logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def test_bitsandbytes_4bit_target_runs_end_to_end(tmp_path):
    model = tiny_causal_lm("llama", hidden_size=128, intermediate_size=256)
    model.save_pretrained(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    )
    enable_viasd(target)
    ids = repetitive_prompt(0)
    expected = target.generate(ids, max_new_tokens=12, **GREEDY)
    mask = RoutingMask.from_model(target, skip=[2])
    out = target.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=12, return_dict_in_generate=True,
                          viasd_config=ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False), **GREEDY)
    assert out.sequences.shape == expected.shape
    assert_stats_consistent(out.viasd_stats, 12, "lossless")
    assert out.viasd_stats.drafted_tokens > 0 and out.viasd_stats.slim_forwards > 0


def test_peft_target_runs_end_to_end(pair):
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(pair[0])
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    merged = copy.deepcopy(peft_model).merge_and_unload()  # the same function as the PEFT target: a perfect drafter
    ids = prompt(0)
    expected = peft_model.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
    enable_viasd(peft_model)
    mask = RoutingMask.from_model(peft_model, skip=[2])
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False, tau_accept=0.0, tau_escalate=0.0)
    out = peft_model.generate(input_ids=ids, assistant_model=merged, max_new_tokens=12, return_dict_in_generate=True,
                              viasd_config=config, **GREEDY)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 12, "lossless")
    assert_drafted_and_repaired_with_every_tier(stats, model_drafter=True)
    assert stats.accepted_tokens == stats.drafted_tokens, "the LoRA target must accept every draft of its merged copy"


def test_accelerate_offloaded_target_equals_generate(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(6)}
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                  offload_folder=tmp_path / "offload").eval()
    ids = repetitive_prompt(11)
    expected = target.generate(ids, max_new_tokens=12, **GREEDY)
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[3]), mode="lossless", adaptive=False)
    out = viasd(target, ids, config, max_new_tokens=12, prompt_lookup_num_tokens=3)
    assert torch.equal(out.sequences, expected)
    assert_stats_consistent(out.viasd_stats, 12, "lossless")
    assert_drafted_and_repaired_with_every_tier(out.viasd_stats, model_drafter=False)


def test_bfloat16_target_and_drafter_run_end_to_end():
    target = tiny_causal_lm("qwen2", seed=0, dtype=torch.bfloat16)
    assistant = perturbed_copy(target, 0.003, seed=2)
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[2]), adaptive=False)
    out = viasd(target, prompt(12), config, drafter=assistant, max_new_tokens=16)
    assert_stats_consistent(out.viasd_stats, 16, "tiered")
    assert out.viasd_stats.accepted_tokens >= 1 and out.viasd_stats.slim_forwards >= out.viasd_stats.blocks - 1


def test_custom_generate_folder_matches_enable_viasd(pair, masks):
    from pathlib import Path

    repo_root = Path(__file__).resolve().parents[1]
    target, assistant = pair
    config = ViaSDConfig.paper(routing_mask=masks[0], adaptive=False)
    ids = prompt(13)
    from_folder = target.generate(ids, custom_generate=str(repo_root), trust_remote_code=True, assistant_model=assistant,
                                  viasd_config=config, max_new_tokens=20, return_dict_in_generate=True, **GREEDY)
    enabled = enable_viasd(copy.deepcopy(target))
    expected = enabled.generate(ids, assistant_model=assistant, viasd_config=config, max_new_tokens=20,
                                return_dict_in_generate=True, **GREEDY)
    assert torch.equal(from_folder.sequences, expected.sequences)
    assert work_done(from_folder.viasd_stats) == work_done(expected.viasd_stats)
    assert_stats_consistent(from_folder.viasd_stats, 20, "tiered")
    assert from_folder.viasd_stats.slim_committed_tokens > 0 and from_folder.viasd_stats.drafter_forwards > 0


@pytest.mark.parametrize("slim_tier", [False, True], ids=["two-tier", "slim-tier-on"])
def test_only_blocks_the_slim_tier_may_verify_are_kept_within_its_backlog(pair, slim_tier, monkeypatch):
    """The stop rule ends blocks; the bound is only a bound: 32 drafts when only the full model verifies, and below
    ``max_slim_backlog`` when the slim tier may verify the block."""
    target, _ = pair
    monkeypatch.setattr(DraftPlanner, "keep_drafting_rows", lambda self, confidences, drafting: True)
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(target, skip=[2]), use_slim=slim_tier,
                         reproducible=True, num_draft_tokens=5)  # fmt: skip
    out = viasd(target, prompt(0), config, max_new_tokens=40, assistant_model=target)
    longest = len(out.viasd_stats.drafted_at_position)
    assert longest == (min(3 * 5, config.knobs.max_slim_backlog - 1) if slim_tier else LONGEST_TWO_TIER_DRAFT)


@pytest.mark.parametrize("hybrid", [False, True], ids=["model", "hybrid"])
def test_the_drafter_processes_the_prompt_before_the_first_block(masks, hybrid, speculating):
    """The prompt is the drafter's prefill, whose logits give the first draft token (as HF's assistant): every
    drafting pass feeds a token or two, so the draft planner and the tier controller, which price drafting from
    their timings, never see a long prompt make the drafter look dear for dozens of blocks."""
    target = enable_viasd(tiny_causal_lm("llama", seed=0))
    assistant = perturbed_copy(target, 0.003, seed=1)
    fed: list[int] = []
    handle = assistant.register_forward_pre_hook(lambda module, args, kwargs: fed.append((args[0] if args else kwargs["input_ids"]).shape[1]),
                                                 with_kwargs=True)
    ids = prompt(5, length=24)
    extra = {"prompt_lookup_num_tokens": 3} if hybrid else {}
    config = ViaSDConfig(routing_mask=masks[0], mode="lossless")
    out = target.generate(ids, assistant_model=assistant, viasd_config=config, max_new_tokens=12, return_dict_in_generate=True, **GREEDY, **extra)
    handle.remove()
    assert fed[0] == ids.shape[1], "the whole prompt, in one pass"
    # every drafting pass feeds the newest token (and the one before, after a rejection); after a block that copied
    # (hybrid), the assistant catches up with the copied tokens too
    assert max(fed[1:]) <= 2 + 3 * hybrid, "no drafting pass after the first reads the prompt again"
    assert out.viasd_stats.drafter_forwards == len(fed), "the prefill is counted among the drafter's passes"
