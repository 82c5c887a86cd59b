"""VIA-SD on encoder-decoder targets (T5): the slim tier skips decoder blocks only; the encoder runs once."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_sampling import acceptance, total_variation
from transformers import LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper

from conftest import VOCAB, assert_stats_consistent, tiny_t5
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd, routed
from viasd_hf.engine.batch.drafting import BatchSelfDrafter
from viasd_hf.engine.batch.loop import BatchedDecoder
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream, cascade_target

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def t5():
    model = enable_viasd(tiny_t5(seed=0, dtype=torch.float64))
    slim = RoutingMask.from_model(model, skip=[2])
    heavy = RoutingMask.from_model(model, skip=[1, 2, 3, 4])
    return model, slim, heavy


def source(seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drafter", ["self", "prompt_lookup"])
def test_t5_lossless_greedy_equals_generate(t5, seed, drafter):
    model, slim, heavy = t5
    ids = source(seed)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    extra = {"prompt_lookup_num_tokens": 3} if drafter == "prompt_lookup" else {}
    out = model.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, viasd_check_invariants=True,
                         viasd_config=ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, mode="lossless",
                                                  adaptive=False), **extra)
    assert torch.equal(out.sequences, expected)
    stats = out.viasd_stats
    assert_stats_consistent(stats, 16, "lossless")
    assert stats.prefill_forwards == 0, "the decoder prompt is the start token alone: nothing to prefill"
    assert stats.accepted_tokens >= 1 and stats.decode_full_forwards == 16 - stats.accepted_tokens
    assert 0 < stats.slim_forwards <= stats.blocks
    if drafter == "self":  # the first block is the prompt's pass, and the last may have no room for a draft
        assert stats.drafter_forwards == stats.drafted_tokens >= stats.blocks - 2
        assert stats.slim_forwards >= stats.blocks - 2


def test_t5_tiered_runs_and_counts_add_up(t5):
    model, slim, heavy = t5
    out = model.generate(source(9), max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                         viasd_check_invariants=True,
                         viasd_config=ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, adaptive=False))
    assert type(out).__name__ == "ViaSDEncoderDecoderOutput"
    stats = out.viasd_stats
    assert stats.new_tokens == 20 == stats.accepted_tokens + stats.slim_tokens + stats.full_tokens
    assert_stats_consistent(stats, 20, "tiered")
    assert stats.slim_committed_tokens > 0 and stats.drafter_forwards == stats.drafted_tokens > 0


def test_t5_lossless_sampling_matches_the_target_distribution():
    """Two new tokens: one block that drafts one token from p (the heavier mask) after the start token; the slim tier
    hands the full model a token distributed as the cascade π, which the full model keeps with probability
    Σ min(π, q), and adds its own token."""
    vocab = 8
    model = tiny_t5(seed=4, dtype=torch.float64, vocab_size=vocab)
    slim, heavy = RoutingMask.from_model(model, skip=[2]), RoutingMask.from_model(model, skip=[1, 2, 3, 4])
    ids = torch.tensor([[3, 5, 2, 7, 4, 6]])
    processors = RowProcessors(LogitsProcessorList([TemperatureLogitsWarper(0.7)]))
    encoder_outputs = model.get_encoder()(input_ids=ids)
    start = torch.tensor([[model.config.decoder_start_token_id]])

    @torch.no_grad()
    def probs(decoder_ids):
        logits = model(decoder_input_ids=decoder_ids, encoder_outputs=encoder_outputs).logits[:, -1].double()
        return processors(decoder_ids, logits).softmax(-1)[0]

    first = probs(start)
    exact = {(a, b): (first[a] * probs(torch.tensor([[0, a]]))[b]).item() for a in range(vocab) for b in range(vocab)}
    config = ViaSDConfig.paper(routing_mask=slim, mode="lossless", adaptive=False, tau_accept=0.5)
    encoder = {"encoder_outputs": encoder_outputs, "attention_mask": None}
    counts, n, stats = Counter(), 2500, []
    for seed in range(n):
        torch.manual_seed(seed)
        cache = RaggedCache(model.config, 1, start.device, encoder=encoder)
        drafter = BatchSelfDrafter(model, heavy, cache, processors, None, frozenset())
        decoder = BatchedDecoder(model, drafter, None, config, slim, processors, StoppingCriteriaList(), 3, cache,
                                 RandomStream.from_global_seed(), check_invariants=True)
        counts[tuple(decoder.run(start.clone(), torch.ones_like(start)).sequences(None)[0, 1:].tolist())] += 1
        stats.append(decoder.stats)
    assert total_variation(counts, exact, n) < 0.08

    @torch.no_grad()
    def routed_probs(mask):
        with routed(model, mask):
            logits = model(decoder_input_ids=start, encoder_outputs=encoder_outputs).logits[:, -1].double()
        return processors(start, logits).softmax(-1)[0], logits.softmax(-1)[0]

    p, _ = routed_probs(heavy)
    slim_probs, slim_unscaled = routed_probs(slim)
    handed_on = cascade_target(p, slim_probs, slim_unscaled, config.knobs.tau_accept)
    assert 0.05 < (p * (slim_unscaled > config.knobs.tau_accept * slim_unscaled.max())).sum() < 0.95, "π must mix p and q′"
    for one in stats:
        assert_stats_consistent(one, 2, "lossless")
        assert one.drafted_tokens == one.slim_forwards == 1
    rate = sum(one.accepted_at_position[0] for one in stats) / n
    assert abs(rate - acceptance(handed_on, first)) < 5 * 0.5 / n**0.5
