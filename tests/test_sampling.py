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
from transformers import LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper

import viasd_hf.decoding as decoding
import viasd_hf.sampling as sampling
from conftest import tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, routed, viasd_generate
from viasd_hf.cache import new_cache
from viasd_hf.decoding import DecodingState, ViaSDDecoder
from viasd_hf.drafters import AssistantDrafter, PromptLookupDrafter
from viasd_hf.sampling import cascade_target, rejection_step

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


def exact_two_token_distribution(model) -> dict:
    first = next_probs(model, PROMPT)
    joint = {}
    for a in range(VOCAB):
        if first[a] > 0:
            second = next_probs(model, torch.cat([PROMPT, torch.tensor([[a]])], dim=-1))
            joint |= {(a, b): (first[a] * second[b]).item() for b in range(VOCAB) if second[b] > 0}
    return joint


def run(target, drafter, config, max_new_tokens, seed, prompt_lookup=False) -> list[int]:
    torch.manual_seed(seed)
    chosen = PromptLookupDrafter(3) if prompt_lookup else AssistantDrafter(drafter, processors(), None, do_sample=True)
    decoder = ViaSDDecoder(target, chosen, config, config.routing_mask if config.use_slim else None, processors(),
                           StoppingCriteriaList(), max_length=PROMPT.shape[1] + max_new_tokens, do_sample=True,
                           check_invariants=True)
    state = DecodingState(PROMPT.clone(), new_cache(target.config), full_length=0, prompt_attention_mask=None)
    return decoder.run(state).ids[0, PROMPT.shape[1]:].tolist()


N = 2500


def two_token_tv(models, config, prompt_lookup=False) -> float:
    target, drafter, _ = models
    counts = Counter(tuple(run(target, drafter, config, 2, seed, prompt_lookup)) for seed in range(N))
    return total_variation(counts, exact_two_token_distribution(target), N)


@pytest.mark.parametrize("use_slim", [True, False], ids=["three-tier", "two-tier"])
def test_lossless_sampling_matches_the_target_distribution(models, use_slim):
    config = ViaSDConfig(routing_mask=models[2], mode="lossless", adaptive=False, use_slim=use_slim, tau_accept=0.5)
    assert two_token_tv(models, config) < 0.07


def test_lossless_sampling_with_prompt_lookup_matches_the_target(models):
    config = ViaSDConfig(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    assert two_token_tv(models, config, prompt_lookup=True) < 0.07


def test_the_tv_bound_catches_a_wrong_residual(models, monkeypatch):
    def resample_from_target(token, proposal, target):
        return None if torch.rand(()) * proposal[token] < target[token] else sampling.sample(target)

    monkeypatch.setattr(decoding, "rejection_step", resample_from_target)
    monkeypatch.setattr(sampling, "rejection_step", resample_from_target)
    config = ViaSDConfig(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    assert two_token_tv(models, config) > 0.07


def test_the_tv_bound_catches_a_wrong_proposal(models, monkeypatch):
    monkeypatch.setattr(decoding.ViaSDDecoder, "repaired_by_slim", lambda self, state, draft: decoding.Repair(draft))
    monkeypatch.setattr(sampling, "cascade_target", lambda p, q, unscaled, tau: q)
    original = decoding.ViaSDDecoder.verify_with_full_model

    def verify_against_slim(self, state, draft):
        _, slim_scores = self.slim_pass(state, draft)
        wrong = copy.copy(draft)
        wrong.probs = list(slim_scores.softmax(-1)[: len(draft.tokens)])
        return original(self, state, wrong)

    monkeypatch.setattr(decoding.ViaSDDecoder, "verify_with_full_model", verify_against_slim)
    config = ViaSDConfig(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    assert two_token_tv(models, config) > 0.07


def test_tiered_sampling_commits_the_cascade_mixture(models):
    target, drafter, mask = models
    config = ViaSDConfig(routing_mask=mask, mode="tiered", tau_accept=0.6, tau_escalate=0.0, adaptive=False)
    first = Counter(run(target, drafter, config, 2, seed)[0] for seed in range(N))
    with torch.no_grad(), routed(target, mask):
        unscaled = target(PROMPT, use_cache=False).logits[0, -1].double().softmax(-1)
    mixture = cascade_target(next_probs(drafter, PROMPT), next_probs(target, PROMPT, mask), unscaled, 0.6)
    exact = {v: mixture[v].item() for v in range(VOCAB)}
    assert total_variation(first, exact, N) < 0.05
    full = {v: p.item() for v, p in enumerate(next_probs(target, PROMPT))}
    assert total_variation(Counter({v: exact[v] * N for v in exact}), full, N) > 0.05, "the mixture must differ from q"


def test_cascade_sampling_commits_the_mixture_of_drafter_and_full_model(models):
    """The two-model cascade baseline: π built from the drafter and the *full* model at lenience α."""
    target, drafter, _ = models
    config = ViaSDConfig(use_slim=False, cascade_lenience=0.4)
    first = Counter(run(target, drafter, config, 2, seed)[0] for seed in range(N))
    with torch.no_grad():
        unscaled = target(PROMPT, use_cache=False).logits[0, -1].double().softmax(-1)
    mixture = cascade_target(next_probs(drafter, PROMPT), next_probs(target, PROMPT), unscaled, 0.6)
    exact = {v: mixture[v].item() for v in range(VOCAB)}
    assert total_variation(first, exact, N) < 0.05
    full = {v: p.item() for v, p in enumerate(next_probs(target, PROMPT))}
    assert total_variation(Counter({v: exact[v] * N for v in exact}), full, N) > 0.05, "the mixture must differ from q"


def test_rejection_step_is_exact_for_any_proposal():
    torch.manual_seed(0)
    proposal = torch.tensor([0.5, 0.3, 0.1, 0.1])
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = Counter()
    for _ in range(20000):
        token = int(torch.multinomial(proposal, 1))
        resampled = rejection_step(token, proposal, target)
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
                                       temperature=0.7, max_new_tokens=12, pad_token_id=0,
                                       viasd_config=ViaSDConfig.paper(routing_mask=mask)))
    assert torch.equal(outputs[0], outputs[1])
