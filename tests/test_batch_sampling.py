"""Batched lossless sampling is exact per row: each row of a left-padded batch draws its new tokens from the
target's own distribution after that row's prompt, whatever the other rows draft and keep.

The pass over the prompts gives each row its first token (a plain block), so the rows decode three: the first is
forced (``FirstToken``), the next two come from speculative blocks and are compared with the exact two-token
distribution after the prompt and the forced token. The two-token distributions, the models and the TV bound
are ``test_sampling``'s (float64 tiny models, temperature 0.8 and top-k 6); a mutation control shows the bound
catches a proposal the drafter did not draw from.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_batch import PAD, left_padded
from test_sampling import (  # noqa: F401 -- models is the fixture: float64 tiny models and a slim mask
    LOOKUP_PROMPT,
    PROMPT,
    TV_BOUND,
    N,
    exact_two_token_distribution,
    models,
    processors,
    total_variation,
)
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteriaList

import viasd_hf.engine.batch.drafting as drafting
from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.engine.batch import BatchedDecoder, RaggedCache
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.generation import batch_drafter
from viasd_hf.vocabulary.head import SubsetHead

ROWS = [PROMPT, LOOKUP_PROMPT]  # 5 and 7 tokens: the first row is left-padded; the second's bigram recurs
FORCED = 7  # every row's first new token; after it the second row's trailing bigram (2, 7) still recurs


class FirstToken(LogitsProcessor):
    """Every row's first new token is ``FORCED`` (``width``: the padded prompts' width, which every row's ids have)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] != self.width:
            return scores
        return torch.full_like(scores, float("-inf")).index_fill(-1, torch.tensor([FORCED]), 0.0)

pytestmark = pytest.mark.usefixtures("single_thread")


def sample_batch(models, config: ViaSDConfig, seed: int, lookup: bool, stats: list,
                 self_drafting: bool = False, head: SubsetHead | None = None) -> list[tuple[int, ...]]:
    """Three new tokens for every row of the batch, the first forced, drawn with the call's seed; each row's last two.
    ``self_drafting``: the target routed with the models' mask drafts instead of the assistant; ``head``: the
    assistant drafts over a draft vocabulary."""
    target, drafter, routing = models
    drafter = None if self_drafting else drafter
    ids, mask = left_padded([row[0] for row in ROWS])
    torch.manual_seed(seed)
    forcing = RowProcessors(LogitsProcessorList([FirstToken(ids.shape[1]), *processors()]), len(ROWS))
    cache = RaggedCache(target.config, len(ROWS), ids.device)
    chosen = batch_drafter(drafter, PromptLookupDrafter(3) if lookup else None, forcing, None, frozenset(), cache,
                           self_drafting=(target, routing) if self_drafting else None, head=head)
    decoder = BatchedDecoder(target, chosen, drafter, config, config.routing_mask if config.use_slim else None,
                             forcing, StoppingCriteriaList(), ids.shape[1] + 3, cache,
                             RandomStream.from_global_seed(), check_invariants=True)  # fmt: skip
    rows = decoder.run(ids, mask)
    stats.append(decoder.stats)
    assert all(row.tokens()[-3] == FORCED for row in rows.every_row())
    return [tuple(row.tokens()[-2:]) for row in rows.every_row()]


def per_row_tv(models, config: ViaSDConfig, lookup: bool = False, self_drafting: bool = False,
               head: SubsetHead | None = None) -> tuple[list[float], list]:
    stats: list = []
    draws = [sample_batch(models, config, seed, lookup, stats, self_drafting, head) for seed in range(N)]
    target = models[0]
    forced = torch.tensor([[FORCED]])
    return [total_variation(Counter(draw[i] for draw in draws),
                            exact_two_token_distribution(target, torch.cat([prompt, forced], -1)), N)
            for i, prompt in enumerate(ROWS)], stats  # fmt: skip


def test_batched_lossless_sampling_is_exact_per_row(models, monkeypatch):
    """The assistant drafts for the first row; the second row's recurring bigram is copied where it can be."""
    copied = []
    copy = drafting.BatchLookup.draft

    def counted(self, *args):
        draft = copy(self, *args)
        copied.append(sum(len(tokens) for tokens in draft.tokens))
        return draft

    monkeypatch.setattr(drafting.BatchLookup, "draft", counted)
    config = ViaSDConfig.paper(routing_mask=models[2], mode="lossless", adaptive=False, tau_accept=0.5)
    distances, stats = per_row_tv(models, config, lookup=True)
    assert max(distances) < TV_BOUND, distances
    assert sum(one.slim_forwards for one in stats) > 0, "the slim tier repaired drafts"
    rows = [row for one in stats for row in one.rows]
    assert sum(row.accepted_tokens for row in rows) > 0 and sum(row.drafted_tokens for row in rows) > 0
    assert sum(copied) > 0, "copied drafts (no proposal distribution) were verified beside drawn ones"


def test_batched_lossless_sampling_drafted_by_the_self_drafter_is_exact_per_row(models):
    """The target routed with the mask drafts on the target's own cache, provisionally, for every row at once."""
    config = ViaSDConfig.paper(mode="lossless", use_slim=False, adaptive=False)
    distances, stats = per_row_tv(models, config, self_drafting=True)
    assert max(distances) < TV_BOUND, distances
    rows = [row for one in stats for row in one.rows]
    assert sum(row.drafted_tokens for row in rows) > sum(row.accepted_tokens for row in rows) > 0


def test_batched_lossless_sampling_over_a_draft_vocabulary_is_exact_per_row(models, monkeypatch):
    """The assistant proposes its processed softmax over half the tokens and hands exactly that proposal on."""
    vocabulary = list(range(0, models[0].config.vocab_size, 2))
    proposals = []
    drawn = drafting.drafted_token
    monkeypatch.setattr(drafting, "drafted_token", lambda *args: (
        lambda chosen: proposals.append(chosen) or chosen)(drawn(*args)))
    config = ViaSDConfig.paper(mode="lossless", use_slim=False, adaptive=False)
    distances, stats = per_row_tv(models, config, head=SubsetHead(models[1], vocabulary))
    assert max(distances) < TV_BOUND, distances
    # the first new token is forced (FORCED, outside the vocabulary) by a processor, whichever tier proposes it
    drafted = [chosen for chosen in proposals if chosen is not None and chosen[0] != FORCED]
    assert drafted and all(token in vocabulary for token, _ in drafted)
    outside = [token for token in range(models[0].config.vocab_size) if token not in vocabulary]
    assert all(float(probs[outside].sum()) == 0.0 for _, probs in drafted), "no proposal mass outside the vocabulary"


def test_the_per_row_bound_catches_a_proposal_the_drafter_did_not_draw_from(models, monkeypatch):
    """The assistant draws its tokens as usual but tells the verifiers they were drawn uniformly: rejection sampling
    then keeps nearly every draft, and the rows follow the drafter's distribution instead of the target's."""
    drawn = drafting.drafted_token

    def uniform(scores, do_sample, rng):
        chosen = drawn(scores, do_sample, rng)
        return None if chosen is None else (chosen[0], torch.full_like(chosen[1], 1 / chosen[1].numel()))

    monkeypatch.setattr(drafting, "drafted_token", uniform)
    config = ViaSDConfig.paper(mode="lossless", use_slim=False, adaptive=False)
    distances, _ = per_row_tv(models, config)
    assert max(distances) > TV_BOUND, distances


@pytest.mark.parametrize("drafting", ["prompt_lookup", "hybrid"])
def test_several_sequences_per_prompt_are_sampled_with_prompt_lookup_too(models, drafting):
    """``num_return_sequences`` > 1 with prompt lookup (alone or beside the assistant), which ``generate``'s own
    assisted generation refuses: each prompt's copies are rows of one batch, reproducibly under one seed."""
    target, drafter, _ = models
    enable_viasd(target)
    ids = torch.tensor([[1, 5, 2, 7, 3, 5, 2, 7, 3]])
    extra = {"assistant_model": drafter} if drafting == "hybrid" else {}
    settings = {"do_sample": True, "temperature": 0.8, "max_new_tokens": 6, "pad_token_id": PAD,
                "num_return_sequences": 3, "prompt_lookup_num_tokens": 2, "return_dict_in_generate": True}
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(target.generate(ids, viasd_config=ViaSDConfig(use_slim=False), **settings, **extra))
    assert runs[0].sequences.shape[0] == 3 and runs[0].viasd_stats.batch_size == 3
    assert torch.equal(runs[0].sequences, runs[1].sequences), "one seed, one output"


def test_generate_samples_a_batch_and_several_sequences_per_prompt(models):
    """Through ``generate``: a sampled batch and ``num_return_sequences`` copies of each prompt decode as one batch,
    reproducibly under one seed."""
    target, drafter, _ = models
    enable_viasd(target)
    ids, mask = left_padded([row[0] for row in ROWS])
    settings = {"do_sample": True, "temperature": 0.8, "top_k": 6, "max_new_tokens": 6, "pad_token_id": PAD,
                "return_dict_in_generate": True, "num_return_sequences": 3}  # fmt: skip
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(target.generate(ids, attention_mask=mask, assistant_model=drafter,
                                    viasd_config=ViaSDConfig(use_slim=False), **settings))  # fmt: skip
    out = runs[0]
    assert out.sequences.shape[0] == 2 * 3 and out.viasd_stats.batch_size == 6
    assert torch.equal(out.sequences, runs[1].sequences), "one seed, one output"
    assert len({tuple(row) for row in out.sequences[:3, -6:].tolist()}) > 1, "the copies of a prompt sample apart"
