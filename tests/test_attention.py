"""Short-query attention steered to the kernel measured faster: the same attention, only inside the context."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import VOCAB, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.engine import attention
from viasd_hf.engine.attention import fastest_attention, forget_kernel_choices, kernel_choices
from viasd_hf.engine.kv_cache import new_cache


def prompt_ids() -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1234))


@pytest.fixture
def always(monkeypatch):
    """Make the measurement choose the given kernel where it computes the call (else SDPA), so every path is tested
    whatever this machine measures."""

    def choose(name: str) -> None:
        def measure(kernels):
            chosen = name if name in kernels else "sdpa"
            return chosen, kernels[chosen]()

        monkeypatch.setattr(attention, "_measure", measure)
        forget_kernel_choices()

    yield choose
    forget_kernel_choices()


def cached_logits(model, rows: int) -> torch.Tensor:
    """Logits of ``rows`` new tokens over a cache of the first 12: a verifying pass (causal inside the block)."""
    ids = prompt_ids()
    with torch.no_grad():
        cache = new_cache(model.config)
        model(ids[:, :-rows], cache=cache, use_cache=True)
        return model(ids[:, -rows:], cache=cache, use_cache=True).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("kernel", ["eager", "sdpa", "grouped"])
def test_steered_attention_computes_what_sdpa_computes(kind, kernel, always):
    model = tiny_causal_lm(kind, seed=0)
    always(kernel)
    plain = {rows: cached_logits(model, rows) for rows in (1, 5)}
    with fastest_attention():
        steered = {rows: cached_logits(model, rows) for rows in (1, 5)}
    for rows in plain:
        torch.testing.assert_close(steered[rows], plain[rows], rtol=1e-5, atol=1e-5)
    chosen = {bucket.query_rows: choice for bucket, choice in kernel_choices().items()}
    assert chosen[8] == kernel
    assert chosen[1] == ("sdpa" if kernel == "grouped" else kernel), "transformers folds a single query row itself"


def test_grouped_queries_read_each_key_value_head_once(always, monkeypatch):
    """A verifying pass of a model whose query heads share key/value heads: SDPA copies every cached key and value
    once per query head reading it (``repeat_kv``); the grouped kernel copies none, for the same logits."""
    from transformers.integrations import sdpa_attention

    copied = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda states, n: copied.append(states.shape) or repeat_kv(states, n))
    model = tiny_causal_lm("qwen2", seed=0)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    plain = cached_logits(model, 5)
    layers = model.config.num_hidden_layers
    assert len(copied) == 2 * layers, "SDPA repeats keys and values in every layer"
    always("grouped")
    with fastest_attention():
        cached_logits(model, 5)  # the first call of the bucket runs (and here chooses) the kernel
        copied.clear()
        grouped = cached_logits(model, 5)
    assert not copied
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)


def test_the_context_leaves_transformers_as_it_was_and_nests():
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with fastest_attention():
        with fastest_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward, "the outer call still steers"
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping, "no override left behind"
    with fastest_attention(enabled=False):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_an_override_of_sdpa_made_before_the_context_is_restored_after_it():
    def users_sdpa(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = users_sdpa
    try:
        with fastest_attention():
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not users_sdpa
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_another_thread_runs_sdpa_while_a_call_steers(always):
    """Steering belongs to the call that asked: plain generate in another thread measures and steers nothing."""
    model = tiny_causal_lm("llama", seed=0)
    always("eager")
    expected = cached_logits(model, 1)
    seen = {}
    with fastest_attention():
        worker = threading.Thread(target=lambda: seen.update(logits=cached_logits(model, 1)))
        worker.start()
        worker.join()
    assert not kernel_choices()
    torch.testing.assert_close(seen["logits"], expected, rtol=0, atol=0)


def test_prefill_and_maskless_blocks_stay_on_sdpa(always):
    """Long queries are SDPA's ground, and a block without a mask is causal only through SDPA's is_causal."""
    model = tiny_causal_lm("llama", seed=0)
    always("eager")
    with fastest_attention(), torch.no_grad():
        model(prompt_ids(), use_cache=False)
    assert not kernel_choices()
    with fastest_attention(), torch.no_grad():
        model(prompt_ids()[:, :1], use_cache=False)
    assert {bucket.query_rows for bucket in kernel_choices()} == {1}


@pytest.mark.parametrize("kernel", ["eager", "sdpa", "grouped"])
def test_lossless_greedy_with_steered_attention_is_token_identical_to_generate(kernel, always):
    target = enable_viasd(tiny_causal_lm("qwen2", seed=0))
    drafter = near_copy(target)
    always(kernel)
    ids = prompt_ids()
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    config = ViaSDConfig(mode="lossless", routing_mask=RoutingMask.from_model(target, skip=[1]))
    out = target.generate(ids, assistant_model=drafter, viasd_config=config, max_new_tokens=24,
                          do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)
    assert kernel in set(kernel_choices().values())


def test_reproducible_calls_do_not_steer(always):
    """Sampling (and tiered decoding) keeps the model's own kernel: a measured choice must not change their draws."""
    target = enable_viasd(tiny_causal_lm("qwen2", seed=0))
    always("eager")
    torch.manual_seed(0)
    config = ViaSDConfig(mode="lossless", routing_mask=RoutingMask.from_model(target, skip=[1]))
    target.generate(prompt_ids(), assistant_model=near_copy(target), viasd_config=config,
                    max_new_tokens=8, do_sample=True, pad_token_id=0)
    assert not kernel_choices()


def test_the_kernel_choice_is_a_validated_config_field_and_a_bench_lever():
    from viasd_hf.bench.methods import STEERED_REFERENCE, MethodName

    with pytest.raises(ValueError, match="attention must be one of"):
        ViaSDConfig(mode="tiered", attention="eager")
    assert MethodName.parse("viasd_lossless_sdpa").ablations == ("_sdpa",)
    assert MethodName.parse(STEERED_REFERENCE).base == STEERED_REFERENCE
    assert MethodName.parse(STEERED_REFERENCE + "_sdpa") is None, "ablations are ours only"


def test_a_boolean_mask_is_converted_once_per_pass_and_afresh_for_the_next():
    causal = torch.ones(1, 1, 3, 7, dtype=torch.bool).tril(diagonal=4)
    first = attention._additive(causal, torch.bfloat16)
    assert attention._additive(causal, torch.bfloat16) is first  # the next layer of the same pass
    assert torch.equal(first == 0, causal) and first.dtype == torch.bfloat16
    next_pass = causal.clone()
    next_pass[..., 0] = False
    converted = attention._additive(next_pass, torch.bfloat16)
    assert converted is not first and torch.equal(converted == 0, next_pass)
    assert attention._additive(next_pass, torch.float32).dtype == torch.float32
    next_pass[..., 1] = False  # the same mask object, changed in place
    assert torch.equal(attention._additive(next_pass, torch.float32) == 0, next_pass)


def test_a_float64_model_stays_on_sdpa_whose_softmax_is_as_exact(always):
    always("eager")
    model = tiny_causal_lm("llama", dtype=torch.float64)
    with fastest_attention():
        steered = cached_logits(model, rows=3)
    assert torch.equal(steered, cached_logits(model, rows=3))
    assert "eager" not in kernel_choices().values()
