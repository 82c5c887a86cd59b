"""An assistant drafter that reads only part of a long prompt (``ViaSDConfig.drafter_context``)."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, viasd_generate

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return target, near_copy(target)


@pytest.mark.parametrize("context", [1, 5, 12, 40])
@pytest.mark.parametrize("lookup", [False, True])
def test_lossless_greedy_with_a_windowed_drafter_equals_generate(pair, context, lookup, monkeypatch, speculating):
    target, drafter = pair
    ids = prompt(context, 24) if not lookup else prompt(context, 8).repeat(1, 3)
    from viasd_hf.engine.batch.drafting import BatchAssistant

    skipped = []  # what the assistant skipped of the prompt when it read it
    read = BatchAssistant.read
    monkeypatch.setattr(BatchAssistant, "read", lambda self, rows: (read(self, rows), skipped.extend(self.skipped))[0])
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless", drafter_context=context)
    extra = {"prompt_lookup_num_tokens": 3} if lookup else {}
    out = target.generate(ids, custom_generate=viasd_generate, viasd_config=config, drafter=drafter,
                          max_new_tokens=24, viasd_check_invariants=True, return_dict_in_generate=True, **GREEDY, **extra)
    assert torch.equal(out.sequences, expected)
    assert out.viasd_stats.drafter_forwards and out.viasd_stats.drafted_tokens, "the assistant drafted"
    unread = {window.stop - window.start for window in skipped}
    assert unread == {max(ids.shape[1] - context, 0)}, "the drafter read only the last drafter_context prompt tokens"


def test_the_drafter_context_is_a_validated_config_field_and_a_bench_lever():
    from viasd_hf.bench.methods import MethodName, MethodSettings
    from viasd_hf.cli.args import tokens_or_none

    with pytest.raises(ValueError, match="drafter_context must be >= 1"):
        ViaSDConfig(mode="tiered", drafter_context=0)
    with pytest.raises(TypeError, match="drafter_context must be an int or None"):
        ViaSDConfig(mode="tiered", drafter_context="256")
    assert ViaSDConfig.from_dict(ViaSDConfig(mode="tiered", drafter_context=64).to_dict()).drafter_context == 64
    assert MethodName.parse("viasd_lossless_hybrid_fullprompt").ablations == ("_fullprompt",)
    assert MethodSettings(drafter_context=32).drafting()["drafter_context"] == 32
    assert tokens_or_none("none") is None and tokens_or_none("12") == 12


@pytest.mark.parametrize("context", [1, 6, 14])
@pytest.mark.parametrize("lookup", [False, True])
def test_a_batch_with_a_windowed_drafter_is_lossless_and_reads_each_row_windowed(pair, context, lookup, monkeypatch, speculating):
    from viasd_hf.engine.batch.drafting import BatchAssistant

    target, drafter = pair
    rows = [prompt(context + n, n) if not lookup else prompt(context + n, n // 3).repeat(1, 3) for n in (21, 9, 15)]
    width = max(row.shape[1] for row in rows)
    ids = torch.cat([torch.nn.functional.pad(row, (width - row.shape[1], 0)) for row in rows])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(row), (width - row.shape[1], 0)) for row in rows])
    reads = []  # each read: every row's tokens then, the positions the drafter skipped, and what its cache holds
    read = BatchAssistant.read
    monkeypatch.setattr(BatchAssistant, "read", lambda self, rows: (read(self, rows), reads.append((
        [len(row.tokens()) for row in rows.active], list(self.skipped), self.cache.lengths().tolist())))[0])
    config = ViaSDConfig(mode="lossless", use_slim=False, drafter_context=context)
    extra = {"prompt_lookup_num_tokens": 3} if lookup else {}
    out = target.generate(ids, attention_mask=mask, custom_generate=viasd_generate, viasd_config=config,
                          drafter=drafter, max_new_tokens=16, viasd_check_invariants=True,
                          return_dict_in_generate=True, **GREEDY, **extra)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    assert torch.equal(out.sequences, expected)
    assert out.viasd_stats.drafter_forwards and out.viasd_stats.drafted_tokens, "the assistant drafted"
    lengths, skipped, held = reads[0]
    assert [window.stop - window.start for window in skipped] == [max(n - context, 0) for n in lengths], (
        "each row's first read skipped all but its sinks and latest tokens, drafter_context in all")
    assert held == [min(n, context) for n in lengths], "the read fed the window, its newest token included"
