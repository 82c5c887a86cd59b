"""Batched VIA-SD on models with sliding-window attention: every row is what greedy ``generate`` gives its prompt
alone, for models whose layers all slide and for those that alternate sliding and full attention.

The window is short (4 tokens) and prompts and outputs are longer, so it matters. The target's layers past its
second are damped and the assistant is its first two layers: rows keep different numbers of drafts, so the ragged
cache holds holes inside rows' windows, and a window counted in columns rather than tokens changes the output (the
mutation control). The single-sequence path and the drafter-precision measurement run on such caches too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from conftest import VOCAB, left_padded, random_prompts, without_layers
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.engine.batch import position_masks
from viasd_hf.engine.batch.position_masks import SlidingWindows, layer_windows, unmaskable
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.models.quantization import MeasureOptions
from viasd_hf.models.quantization.choice import cached_measure

PAD, EOS = 0, 1
WINDOW = 4
GREEDY = {"do_sample": False, "pad_token_id": PAD, "eos_token_id": EOS}
NEW_TOKENS = 24
DAMPING = 0.7  # the target's upper layers' weights are scaled by this: its first two layers draft well, not perfectly
# model_type -> what it needs beside the common fields to be small and to slide
SLIDING = {
    "mistral": {},  # every layer slides
    "gemma2": {"head_dim": 8},  # alternating sliding and full layers; soft-capped attention, so eager
    "gemma3_text": {"head_dim": 8, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 2},  # full layers first, then sliding ones
    "starcoder2": {},
    "phi3": {},
}
CONFIGS = {
    "default": ViaSDConfig(),
    "always_drafting": ViaSDConfig.paper(mode="lossless", adaptive=False, draft_confidence_threshold=None),
}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


def sliding_model(kind: str, layers: int = 6, damped_from: int | None = 2, **overrides) -> PreTrainedModel:
    """A random ``kind`` model whose sliding layers see ``WINDOW`` tokens; its layers from ``damped_from`` on add
    less to the residual stream (``DAMPING``), so its first layers alone draft well but not perfectly."""
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS, sliding_window=WINDOW)
    fields |= SLIDING[kind] | overrides
    if "layer_types" in fields:  # a pattern, repeated over the layers
        fields["layer_types"] = [fields["layer_types"][i % len(fields["layer_types"])] for i in range(layers)]
    config = AutoConfig.for_model(kind, **fields)
    config._name_or_path = f"tiny-random-sliding-{kind}"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if damped_from is not None:
        with torch.no_grad():
            for layer in model.get_decoder().layers[damped_from:]:
                for linear in (module for module in layer.modules() if isinstance(module, torch.nn.Linear)):
                    linear.weight.mul_(DAMPING)
    return model


@pytest.fixture(scope="module", params=list(SLIDING))
def pair(request):
    """A sliding-window target and its assistant: its first two layers, of the same architecture."""
    target = sliding_model(request.param)
    assistant = without_layers(target, skip=list(range(2, target.config.num_hidden_layers)))
    enable_viasd(target)
    return target, assistant


def prompts(lengths=(11, 6, 9), repeat: bool = False) -> list[torch.Tensor]:
    """Prompts of different lengths, all longer than the window; ``repeat``: n-grams recur, so prompt lookup copies."""
    return random_prompts(0, lengths, repeat)


def assert_rows_are_their_own_generate(target, rows: list[torch.Tensor], out) -> None:
    width = max(len(row) for row in rows)
    for i, row in enumerate(rows):
        alone = target.generate(row[None], viasd_config=None, max_new_tokens=NEW_TOKENS, **GREEDY)[0, len(row) :]
        mine = out.sequences[i, width:]
        assert mine[: len(alone)].tolist() == alone.tolist(), f"row {i}"
        assert bool((mine[len(alone) :] == PAD).all()), f"row {i} is padded after it stopped"


def decode_batch(target, rows: list[torch.Tensor], config: ViaSDConfig, **drafter):
    ids, mask = left_padded(rows)
    return target.generate(ids, attention_mask=mask, viasd_config=config, max_new_tokens=NEW_TOKENS,
                           return_dict_in_generate=True, viasd_check_invariants=True, **GREEDY | drafter)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("drafter", ["assistant", "prompt_lookup"])
def test_every_row_equals_its_own_greedy_generate(pair, drafter, config):
    target, assistant = pair
    rows = prompts(repeat=drafter == "prompt_lookup")
    chosen = {"assistant_model": assistant} if drafter == "assistant" else {"prompt_lookup_num_tokens": 3}
    out = decode_batch(target, rows, CONFIGS[config], **chosen)
    assert_rows_are_their_own_generate(target, rows, out)
    if drafter == "assistant" and config == "always_drafting":
        stats = out.viasd_stats
        assert 0 < stats.accepted_tokens < stats.drafted_tokens, "rows kept some drafts and left others as holes"


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_the_slim_tier_and_the_self_drafter_skip_layers_of_a_sliding_window_batch(kind):
    target = sliding_model(kind)
    enable_viasd(target)
    config = ViaSDConfig.paper(mode="lossless", routing_mask=RoutingMask.from_model(target, skip=[2]), adaptive=False,
                         self_draft_mask=RoutingMask.from_model(target, skip=[2, 3, 4]))
    rows = prompts()
    out = decode_batch(target, rows, config)
    assert_rows_are_their_own_generate(target, rows, out)
    assert out.viasd_stats.slim_forwards > 0 and out.viasd_stats.drafted_tokens > 0


def test_a_window_counted_in_columns_would_change_the_output(monkeypatch):
    """The mutation control: the same masks with column indices for positions (transformers' own window) give
    rows that are not their prompts' own greedy output."""
    target = sliding_model("mistral")
    assistant = without_layers(target, skip=[2, 3, 4, 5])
    enable_viasd(target)
    by_kind = position_masks.by_kind

    def by_column(seen, positions, windows, model):
        return by_kind(seen, torch.arange(positions.shape[1]).expand_as(positions), windows, model)

    monkeypatch.setattr(position_masks, "by_kind", by_column)
    rows = prompts()
    out = decode_batch(target, rows, CONFIGS["always_drafting"], assistant_model=assistant)
    with pytest.raises(AssertionError):
        assert_rows_are_their_own_generate(target, rows, out)


@pytest.mark.parametrize("kind, attention", [("mistral", "sdpa"), ("mistral", "eager"), ("gemma2", "eager"),
                                             ("gemma3_text", "sdpa")])
def test_holes_inside_a_window_change_no_logit(kind, attention):
    """One row fed contiguously after left padding, the other with a hole after every token: both rows' logits are
    the model's own on the contiguous sequence, in the pass that feeds them and in the next one."""
    target = sliding_model(kind, damped_from=None, attn_implementation=attention)
    assert target.config._attn_implementation == attention
    ids = torch.randint(2, VOCAB, (1, 11), generator=torch.Generator().manual_seed(1))
    expected = target(ids).logits[0]
    cache = RaggedCache(target.config, 2, torch.device("cpu"))
    tokens = torch.zeros((2, 20), dtype=torch.long)
    real = torch.zeros((2, 20), dtype=torch.bool)
    tokens[0, 10:], real[0, 10:] = ids[0, :10], True
    tokens[1, ::2], real[1, ::2] = ids[0, :10], True
    logits = cache.run(target, tokens, real, keep=20)
    torch.testing.assert_close(logits[0, 10:], expected[:10])
    torch.testing.assert_close(logits[1, ::2], expected[:10])
    newest = cache.run(target, ids[:, 10:].expand(2, 1), torch.ones((2, 1), dtype=torch.bool), keep=1)
    torch.testing.assert_close(newest[:, 0], expected[10].expand(2, -1))
    assert all(layer.keys.shape[2] == 21 for layer in cache.cache.layers), "no layer evicts a column"


def test_full_attention_models_keep_transformers_own_masks():
    """A model without sliding windows is masked by transformers from the 2D mask, as before: no masks of ours."""
    target = sliding_model("mistral", sliding_window=None)
    assert SlidingWindows.of(target.config) is None
    cache = RaggedCache(target.config, 2, torch.device("cpu"))
    mask, layout = cache.layout(torch.ones((2, 3), dtype=torch.bool), target)
    assert layout["attention_mask"] is mask


def test_windows_are_read_from_the_config():
    gemma2 = AutoConfig.for_model("gemma2", num_hidden_layers=4, sliding_window=WINDOW)
    assert layer_windows(gemma2) == [("sliding_attention", WINDOW), ("full_attention", None)] * 2
    mistral = AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=WINDOW)
    assert layer_windows(mistral) == [("sliding_attention", WINDOW)] * 2
    assert SlidingWindows.of(AutoConfig.for_model("qwen2", num_hidden_layers=2)) is None  # no use_sliding_window


def test_what_a_batch_cannot_mask_is_refused_with_the_fix():
    chunked = AutoConfig.for_model("llama4_text", num_hidden_layers=4, attention_chunk_size=8)
    assert "chunked_attention layers" in unmaskable(chunked)
    target = sliding_model("mistral")
    target.config._attn_implementation = "flex_attention"
    assert unmaskable(target.config).endswith("(load it with attn_implementation='sdpa')")
    enable_viasd(target)
    ids, mask = left_padded(prompts())
    with pytest.raises(ValueError, match="flex_attention.*attn_implementation='sdpa'.*once per prompt"):
        target.generate(ids, attention_mask=mask, viasd_config=ViaSDConfig(use_slim=False), prompt_lookup_num_tokens=3,
                        max_new_tokens=4, **GREEDY)


# -- one sequence ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_single_prompt_with_an_assistant_equals_generate(config):
    target = sliding_model("mistral")
    assistant = without_layers(target, skip=[2, 3, 4, 5])
    enable_viasd(target)
    prompt = prompts()[0][None]
    out = target.generate(prompt, assistant_model=assistant, viasd_config=CONFIGS[config], max_new_tokens=NEW_TOKENS,
                          **GREEDY)
    assert torch.equal(out, target.generate(prompt, viasd_config=None, max_new_tokens=NEW_TOKENS, **GREEDY))


def test_the_drafter_precision_is_measured_on_a_sliding_window_cache(tmp_path, monkeypatch):
    """The timed passes are cropped back after each, and the bf16 form's cache is cast from the float32 form's: a
    sliding-window layer's count of the tokens it has seen goes with its keys."""
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    options = MeasureOptions(prompts=2, prompt_tokens=16, context=16, repeats=2, threads=1)
    measurements = cached_measure(sliding_model("mistral", layers=2), ["fp32"], options, progress=False)
    assert [(m.scheme, m.error) for m in measurements] == [("bf16", None), ("fp32", None)]
