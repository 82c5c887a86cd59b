"""Exact speculative sampling: lossless mode samples the target's distribution; tiered mode the cascade's.

Distribution tests draw many seeded samples and bound the total-variation distance to the exact
distribution computed from the models. ``test_the_tv_bound_catches_*`` show that the same bound
fails when the residual or the proposal handed to the verifier is wrong.
"""

from __future__ import annotations

import copy
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import viasd_hf.engine.accept as accept
import viasd_hf.engine.policies as policies
import viasd_hf.engine.sampling as sampling
from conftest import assert_stats_consistent, tiny_causal_lm, work_done
from viasd_hf import RoutingMask, ViaSDConfig, routed, viasd_generate
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.batch.drafting import BatchAssistant, BatchHybrid, BatchLookup
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.batch.loop import BatchedDecoder
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream, cascade_target, rejection_step

VOCAB = 8
PROMPT = torch.tensor([[1, 5, 2, 7, 3]])


def total_variation(counts: Counter, probs: dict, n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def processors() -> LogitsProcessorList:
    return LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)])


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64, vocab_size=VOCAB)
    drafter = tiny_causal_lm("llama", seed=7, dtype=torch.float64, vocab_size=VOCAB, num_hidden_layers=2)
    return target, drafter, RoutingMask.from_model(target, skip=[2, 3])


@torch.no_grad()
def next_probs(model, ids, mask=None) -> torch.Tensor:
    with routed(model, mask) if mask is not None else nullcontext():
        logits = model(ids, use_cache=False).logits[:, -1].double()
    return processors()(ids, logits).softmax(-1)[0]


def processed_and_unscaled(ids, logits) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed probabilities (what tokens are drawn from) and the unscaled ones the tier thresholds and the
    cascade's confident set compare: softmax of the raw logits over the tokens the processors allow."""
    scores = processors()(ids, logits)
    return scores.softmax(-1)[0], logits.masked_fill(scores.isneginf(), float("-inf")).softmax(-1)[0]


@torch.no_grad()
def full_next_probs(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    return processed_and_unscaled(ids, model(ids, use_cache=False).logits[:, -1].double())


@torch.no_grad()
def slim_next_probs(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The slim verifier's processed and unscaled next-token probabilities as the first block computes them.

    The full model prefills the prompt but its last token, and the slim pass reads that cache (docs/design.md, "The KV cache",
    design B), so q′ is not quite the routed model run afresh on the prompt.
    """
    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], cache=cache, use_cache=True)
    with routed(model, mask):
        logits = model(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1].double()
    return processed_and_unscaled(ids, logits)


def exact_two_token_distribution(model, prompt=PROMPT) -> dict:
    first = next_probs(model, prompt)
    joint = {}
    for a in range(VOCAB):
        if first[a] > 0:
            second = next_probs(model, torch.cat([prompt, torch.tensor([[a]])], dim=-1))
            joint |= {(a, b): (first[a] * second[b]).item() for b in range(VOCAB) if second[b] > 0}
    return joint


def run(target, drafter, config, max_new_tokens, seed, prompt_lookup=False, prompt=PROMPT, stats=None,
        hybrid=False) -> list[int]:
    """Sample ``max_new_tokens`` after ``prompt``; the call's ``ViaSDStats`` are appended to ``stats``."""
    torch.manual_seed(seed)
    assistant = BatchAssistant(drafter, RowProcessors(processors()), None, frozenset(), 1, prompt.device)
    chosen = BatchLookup(PromptLookupDrafter(3)) if prompt_lookup else assistant
    if hybrid:
        chosen = BatchHybrid(BatchLookup(PromptLookupDrafter(3)), assistant)
    decoder = BatchedDecoder(target, chosen, drafter, config, config.routing_mask if config.use_slim else None,
                             RowProcessors(processors()), StoppingCriteriaList(), prompt.shape[1] + max_new_tokens,
                             RaggedCache(target.config, 1, prompt.device), RandomStream.from_global_seed(),
                             check_invariants=True)
    tokens = decoder.run(prompt.clone(), torch.ones_like(prompt)).sequences(None)[0, prompt.shape[1]:].tolist()
    if stats is not None:
        stats.append(decoder.stats)
    return tokens


# Seeded draws per distribution test. With the exact sampler the two-token TV distance to the exact distribution
# comes out at 0.055-0.06 for these models at 1,600 draws (0.045-0.05 at 2,500); a wrong residual or a wrong
# proposal gives 0.21-0.32 (``test_the_tv_bound_catches_*``), so TV_BOUND sits well clear of both.
N = 1600
TV_BOUND = 0.09


def two_token_tv(models, config, prompt_lookup=False, prompt=PROMPT, stats=None, hybrid=False) -> float:
    target, drafter, _ = models
    counts = Counter(tuple(run(target, drafter, config, 2, seed, prompt_lookup, prompt, stats, hybrid))
                     for seed in range(N))
    return total_variation(counts, exact_two_token_distribution(target, prompt), N)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Probability that rejection sampling keeps a token drawn from ``p`` against target ``q``: Σ min(p, q)."""
    return torch.minimum(p, q).sum().item()


def first_draft_acceptance(stats: list, mode: str) -> float:
    """Two new tokens: every call's first block drafts one token (a second block has no room to draft).

    Returns the fraction of those drafts that were accepted, after checking the per-call bookkeeping.
    """
    for one in stats:
        assert_stats_consistent(one, 2, mode)
        assert one.drafted_tokens == one.drafted_at_position[0] == 1
    return sum(one.accepted_at_position[0] for one in stats) / len(stats)


# N Bernoulli trials: a standard error of at most 0.01; five of them
ACCEPTANCE_TOLERANCE = 5 * 0.5 / N**0.5



def assert_mixes(p: torch.Tensor, slim_unscaled: torch.Tensor, tau: float) -> None:
    """The slim verifier's confident set A holds some but not all of the drafter's mass: otherwise π = p
    or π = q′ and the slim tier's part of the cascade goes untested."""
    p_in_a = (p * (slim_unscaled > tau * slim_unscaled.max())).sum().item()
    assert 0.05 < p_in_a < 0.95, f"p(A) = {p_in_a}: the cascade must mix drafter and slim verifier"


@pytest.mark.parametrize("use_slim", [True, False], ids=["three-tier", "two-tier"])
def test_lossless_sampling_matches_the_target_distribution(models, use_slim):
    """Exact in distribution, and accepting drafts at the rate theory gives: Σ min(π, q) where π is the
    distribution of the token handed to the full model (the drafter's p, or the slim tier's cascade π)."""
    target, drafter, mask = models
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False, use_slim=use_slim, tau_accept=0.5)
    stats = []
    assert two_token_tv(models, config, stats=stats) < TV_BOUND
    p, q = next_probs(drafter, PROMPT), next_probs(target, PROMPT)
    if use_slim:
        slim, slim_unscaled = slim_next_probs(target, PROMPT, mask)
        assert_mixes(p, slim_unscaled, config.knobs.tau_accept)
        p = cascade_target(p, slim, slim_unscaled, config.knobs.tau_accept)
    assert abs(first_draft_acceptance(stats, "lossless") - acceptance(p, q)) < ACCEPTANCE_TOLERANCE
    assert sum(one.slim_forwards for one in stats) == (N if use_slim else 0)
    if use_slim:
        assert sum(one.regenerated_tokens for one in stats) > 0, "the slim tier repaired some drafts"


LOOKUP_PROMPT = torch.tensor([[1, 5, 2, 7, 3, 5, 2]])  # the trailing bigram recurs: prompt lookup drafts 7


def test_lossless_sampling_with_prompt_lookup_matches_the_target(models):
    target, _, mask = models
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False, tau_accept=0.5)
    stats = []
    assert two_token_tv(models, config, prompt_lookup=True, prompt=LOOKUP_PROMPT, stats=stats) < TV_BOUND
    slim, slim_unscaled = slim_next_probs(target, LOOKUP_PROMPT, mask)
    lookup = torch.zeros(VOCAB, dtype=slim.dtype)
    lookup[7] = 1.0  # a deterministic draft: all its proposal mass on the copied token
    handed_on = cascade_target(lookup, slim, slim_unscaled, config.knobs.tau_accept)
    rate = first_draft_acceptance(stats, "lossless")
    assert abs(rate - acceptance(handed_on, next_probs(target, LOOKUP_PROMPT))) < ACCEPTANCE_TOLERANCE
    assert rate > 0 and sum(one.slim_forwards for one in stats) == N


@pytest.mark.parametrize("prompt", [PROMPT, LOOKUP_PROMPT], ids=["assistant drafts", "lookup drafts"])
def test_hybrid_drafting_samples_the_target_distribution(models, prompt, monkeypatch):
    """Where the context repeats itself the hybrid drafter copies, elsewhere the assistant drafts; lossless sampling
    is exact either way."""
    assistant_drafts = []
    draft = BatchAssistant.draft
    monkeypatch.setattr(BatchAssistant, "draft", lambda self, *args: assistant_drafts.append(1) or draft(self, *args))
    config = ViaSDConfig.paper(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    stats = []
    assert two_token_tv(models, config, prompt=prompt, stats=stats, hybrid=True) < TV_BOUND
    assert bool(assistant_drafts) == (prompt is PROMPT)


def test_the_tv_bound_catches_a_wrong_residual(models, monkeypatch):
    def resample_from_target(token, proposal, target, rng):
        uniform = torch.rand((), generator=rng.on(target.device))
        return None if uniform * proposal[token] < target[token] else sampling.sample(target, rng)

    monkeypatch.setattr(accept, "rejection_step", resample_from_target)
    config = ViaSDConfig.paper(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    assert two_token_tv(models, config) > TV_BOUND


def test_the_tv_bound_catches_a_wrong_proposal(models, monkeypatch):
    def verify_against_slim(self, draft):
        """No repair, and the full model told the drafts follow the slim verifier's distribution."""
        views = self.score(draft.tokens, routed=True)
        return [policies.SlimRepair(Draft(row.tokens, list(view.scores.softmax(-1)[: len(row.tokens)])),
                                    accept.Verdict(len(row.tokens), None)) for view, row in zip(views, draft.rows)], views

    monkeypatch.setattr(BatchedDecoder, "repair", verify_against_slim)
    config = ViaSDConfig.paper(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    assert two_token_tv(models, config) > TV_BOUND


def one_token_tiered_distribution(p, mixture, q, escalated) -> torch.Tensor:
    """What tiered mode commits first when the first block drafts one token d ~ p: an ``escalated`` draft
    is rejection-sampled against the full model's q, any other against the cascade π (``mixture``); a
    rejected draft is replaced from the residual norm(max(0, target − p))."""
    committed = torch.zeros_like(p)
    for target, routed_there in ((q, escalated), (mixture, ~escalated)):
        kept = torch.minimum(p, target)  # p(d) · min(1, target(d) / p(d))
        residual = (target - p).clamp(min=0)
        committed += kept * routed_there + ((p - kept) * routed_there).sum() * residual / residual.sum()
    return committed


def test_tiered_sampling_commits_the_cascade_mixture(models):
    """τ_esc = 0: the slim tier decides every draft except those with confidence 0 — the tokens the slim
    verifier's processors forbid (top-k here), which go to the full model. A kept-or-resampled token follows
    π; the first draft is kept with probability Σ_{d not escalated} min(p, π) + Σ_{d escalated} min(p, q);
    the full model runs for escalated blocks and for a block with no room to draft (after a one-token first
    block), nowhere else."""
    target, drafter, mask = models
    # τ_acc = 0.9: a confident set A small enough that what is committed differs clearly from q as well as p
    config = ViaSDConfig.paper(routing_mask=mask, mode="tiered", tau_accept=0.9, tau_escalate=0.0, adaptive=False)
    stats = []
    first = Counter(run(target, drafter, config, 2, seed, stats=stats)[0] for seed in range(N))
    p, q = next_probs(drafter, PROMPT), next_probs(target, PROMPT)
    slim, slim_unscaled = slim_next_probs(target, PROMPT, mask)
    assert_mixes(p, slim_unscaled, config.knobs.tau_accept)
    mixture = cascade_target(p, slim, slim_unscaled, config.knobs.tau_accept)
    escalated = slim_unscaled / slim_unscaled.max() <= config.knobs.tau_escalate
    committed = one_token_tiered_distribution(p, mixture, q, escalated)
    exact = {v: committed[v].item() for v in range(VOCAB)}
    assert total_variation(first, exact, N) < 0.05
    for other, name in ((q, "q"), (p, "p")):
        assert total_variation(Counter({v: exact[v] * N for v in exact}), dict(enumerate(other.tolist())), N) > 0.05, (
            f"what tiered mode commits must differ from {name}, or this shows nothing")
    rate = first_draft_acceptance(stats, "tiered")
    kept = torch.where(escalated, torch.minimum(p, q), torch.minimum(p, mixture)).sum().item()
    assert abs(rate - kept) < ACCEPTANCE_TOLERANCE
    escalation_rate = sum(one.escalated_blocks for one in stats) / N
    assert abs(escalation_rate - p[escalated].sum().item()) < ACCEPTANCE_TOLERANCE
    assert all(one.slim_forwards == 1 for one in stats)
    one_token_first_blocks = sum(1 - one.accepted_tokens for one in stats)
    assert sum(one.decode_full_forwards for one in stats) == one_token_first_blocks + N * escalation_rate


def test_cascade_sampling_commits_the_mixture_of_drafter_and_full_model(models):
    """The two-model cascade baseline: π built from the drafter and the *full* model at lenience α."""
    target, drafter, _ = models
    config = ViaSDConfig.paper(mode="tiered", use_slim=False, cascade_lenience=0.4)
    stats = []
    first = Counter(run(target, drafter, config, 2, seed, stats=stats)[0] for seed in range(N))
    p = next_probs(drafter, PROMPT)
    mixture = cascade_target(p, *full_next_probs(target, PROMPT), 0.6)
    exact = {v: mixture[v].item() for v in range(VOCAB)}
    assert total_variation(first, exact, N) < 0.05
    full = {v: p.item() for v, p in enumerate(next_probs(target, PROMPT))}
    assert total_variation(Counter({v: exact[v] * N for v in exact}), full, N) > 0.05, "the mixture must differ from q"
    assert abs(first_draft_acceptance(stats, "lossless") - acceptance(p, mixture)) < ACCEPTANCE_TOLERANCE
    assert sum(one.slim_forwards for one in stats) == 0


def test_rejection_step_is_exact_for_any_proposal():
    torch.manual_seed(0)
    proposal = torch.tensor([0.5, 0.3, 0.1, 0.1])
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = Counter()
    rng = RandomStream(0)
    for _ in range(20000):
        token = int(torch.multinomial(proposal, 1))
        resampled = rejection_step(token, proposal, target, rng)
        counts[token if resampled is None else resampled] += 1
    assert total_variation(counts, dict(enumerate(target.tolist())), 20000) < 0.02


def test_cascade_target_limits():
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(cascade_target(p, q, q, tau=1.0), q)
    torch.testing.assert_close(cascade_target(p, q, q, tau=0.0), p)
    mixed = cascade_target(p, q, q, tau=0.5)
    torch.testing.assert_close(mixed.sum(), torch.tensor(1.0))
    torch.testing.assert_close(mixed, torch.tensor([0.0, 0.3, 0.1]) + 0.6 * q)  # A = {1, 2}


def test_sampling_is_reproducible_under_a_seed(models):
    target, drafter, mask = models
    target = copy.deepcopy(target)
    outputs = []
    for _ in range(2):
        torch.manual_seed(123)
        outputs.append(target.generate(PROMPT, custom_generate=viasd_generate, drafter=drafter, do_sample=True,
                                       temperature=0.7, max_new_tokens=12, pad_token_id=0, return_dict_in_generate=True,
                                       viasd_config=ViaSDConfig.paper(routing_mask=mask)))
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert work_done(outputs[0].viasd_stats) == work_done(outputs[1].viasd_stats), "the same work, draw for draw"
    new_tokens = outputs[0].sequences.shape[1] - PROMPT.shape[1]  # the tiny model's EOS may end it early
    assert_stats_consistent(outputs[0].viasd_stats, new_tokens, "tiered", stopped_inside_block=new_tokens < 12)
    assert outputs[0].viasd_stats.drafter_forwards == outputs[0].viasd_stats.drafted_tokens > 0
