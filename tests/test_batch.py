"""Batched VIA-SD's KV cache: rows ragged inside one rectangular cache, holes masked out, compacted and selected."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, tiny_causal_lm
from viasd_hf.engine.batch.ragged_cache import RaggedCache


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


def test_the_ragged_cache_forgets_compacts_and_selects():
    target = tiny_causal_lm("llama")
    cache = RaggedCache(target.config, 2, torch.device("cpu"))
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    cache.run(target, ids, real, keep=1)
    cache.forget_last(torch.tensor([2, 0]))  # row 0 keeps 2 of its 4 tokens: its last two columns become holes
    assert cache.mask.tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    nxt = torch.tensor([[5], [7]])
    before = cache.run(target, nxt, torch.ones((2, 1), dtype=torch.bool), keep=1)
    cache.forget_last(torch.tensor([1, 1]))
    cache.compact()
    assert cache.mask.tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]] and cache.columns == 6
    after = cache.run(target, nxt, torch.ones((2, 1), dtype=torch.bool), keep=1)
    torch.testing.assert_close(after, before)  # the same tokens at the same positions: the same logits
    cache.select(torch.tensor([0]))
    assert cache.mask.tolist() == [[0, 0, 0, 0, 1, 1, 1]] and cache.cache.layers[0].keys.shape[0] == 1
