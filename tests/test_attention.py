"""Short-query attention steered to the kernel measured faster: the same attention, only inside the context."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LogitsProcessor, LogitsProcessorList
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import VOCAB, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.engine import attention
from viasd_hf.engine.attention import STEERED, fastest_attention, forget_kernel_choices, kernel_choices
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
    with fastest_attention([model]):
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
    with fastest_attention([model]):
        cached_logits(model, 5)  # the first call of the bucket runs (and here chooses) the kernel
        copied.clear()
        grouped = cached_logits(model, 5)
    assert not copied
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)


def implementations(model) -> list[str | None]:
    """The attention implementation of every config that ``model``'s modules read, as a list."""
    return [config._attn_implementation for config in attention._configs_of(model)]


def test_the_context_replaces_nothing_of_transformers_and_switches_its_models_back():
    """``"sdpa"`` in transformers' attention functions is the same object before, during and after a steered call;
    the call's models run our own registered implementation meanwhile, nested calls keep it, the last one puts SDPA
    back."""
    model, drafter = tiny_causal_lm("llama", seed=0), tiny_causal_lm("qwen2", seed=0)
    sdpa, sdpa_masks = ALL_ATTENTION_FUNCTIONS["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert sdpa is sdpa_attention_forward and sdpa_masks is sdpa_mask
    assert STEERED in ALL_ATTENTION_FUNCTIONS and STEERED in ALL_MASK_ATTENTION_FUNCTIONS, "registered at import"
    with fastest_attention([model, None, drafter, model]):
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa and ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_masks
        assert set(implementations(model) + implementations(drafter)) == {STEERED}
        with fastest_attention([model]):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
        assert set(implementations(model)) == {STEERED}, "the outer call still steers"
        cached_logits(model, 5)
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa and ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_masks
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping, "no override left behind"
    assert set(implementations(model) + implementations(drafter)) == {"sdpa"}
    assert not attention._switched
    with fastest_attention([model], enabled=False):
        assert set(implementations(model)) == {"sdpa"}


def test_a_users_sdpa_stays_in_place_and_steered_calls_run_it(always):
    calls = []

    def users_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    model = tiny_causal_lm("llama", seed=0)
    always("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = users_sdpa
    try:
        with fastest_attention([model]):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa
            cached_logits(model, 5)
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is users_sdpa
        assert calls and set(kernel_choices().values()) == {"sdpa"}
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


class Raises(LogitsProcessor):
    """Raises on its ``on_call``-th call: a call that fails inside the context, mid-decode."""

    def __init__(self, on_call: int) -> None:
        self.calls, self.on_call = 0, on_call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.on_call:
            raise RuntimeError("a logits processor failed")
        return scores


@pytest.mark.parametrize("batch", [False, True])
def test_a_call_that_raises_leaves_every_model_as_it_was(batch, always):
    target = enable_viasd(tiny_causal_lm("qwen2", seed=0))
    drafter = near_copy(target)
    drafter.set_attn_implementation("eager")  # left as it is, whatever happens
    before = {"target": implementations(target), "drafter": implementations(drafter)}
    always("eager")
    config = ViaSDConfig(mode="lossless", routing_mask=RoutingMask.from_model(target, skip=[1]))  # lossless greedy: timings steer
    ids = prompt_ids() if not batch else torch.cat([prompt_ids(), prompt_ids().flip(1)])
    seen = {}

    class Watching(Raises):
        def __call__(self, input_ids, scores):
            seen.setdefault("target", implementations(target))
            seen.setdefault("drafter", implementations(drafter))
            return super().__call__(input_ids, scores)

    with pytest.raises(RuntimeError, match="a logits processor failed"):
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, viasd_config=config,
                        logits_processor=LogitsProcessorList([Watching(on_call=3)]), max_new_tokens=16,
                        do_sample=False, pad_token_id=0)
    assert seen == {"target": [STEERED], "drafter": ["eager"]}, "the call was steered, the eager drafter untouched"
    assert {"target": implementations(target), "drafter": implementations(drafter)} == before
    assert not attention._switched
    with pytest.raises(KeyError):
        with fastest_attention([target, drafter]):
            raise KeyError("inside")
    assert {"target": implementations(target), "drafter": implementations(drafter)} == before


def test_an_eager_model_is_left_untouched(always):
    model = tiny_causal_lm("llama", seed=0, attn_implementation="eager")
    always("grouped")
    expected = cached_logits(model, 5)
    with fastest_attention([model]):
        assert implementations(model) == ["eager"]
        steered = cached_logits(model, 5)
    assert implementations(model) == ["eager"]
    assert torch.equal(steered, expected) and not kernel_choices(), "eager attention runs as it is, nothing measured"


def test_a_composite_models_sdpa_sub_configs_are_switched_and_its_eager_ones_left(always):
    """Gemma 3 with a vision tower: the text model reads ``text_config``, the vision tower ``vision_config``."""
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1, image_token_index=VOCAB - 1,
                          attn_implementation={"": "sdpa", "text_config": "sdpa", "vision_config": "eager"})
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    before = attention._implementations(model.config)
    always("eager")
    expected = cached_logits(model, 5)
    with fastest_attention([model]):
        assert attention._implementations(model.config) == {"": STEERED, "text_config": {"": STEERED},
                                                            "vision_config": {"": "eager"}}
        steered = cached_logits(model, 5)
    assert attention._implementations(model.config) == before
    torch.testing.assert_close(steered, expected, rtol=1e-5, atol=1e-5)
    assert "eager" in kernel_choices().values()


@pytest.mark.parametrize("module, switched", [("llama", True), ("falcon", True), ("gemma4", False), ("doge", False)])
def test_only_models_that_find_attention_through_the_interface_are_switched(module, switched):
    """Gemma 4 compares its implementation with "sdpa", Doge keeps attention functions of its own: ours would not
    stand for SDPA there. Falcon only sets "sdpa"."""
    name = f"transformers.models.{module}.modeling_{module}"
    importlib.import_module(name)
    assert attention._reads_implementation_by_interface(name) is switched


def test_another_thread_runs_sdpa_while_a_call_steers(always):
    """Steering belongs to the call that asked: plain forwards in another thread, on the very model a steered call has
    switched, measure and steer nothing."""
    model = tiny_causal_lm("llama", seed=0)
    always("eager")
    expected = cached_logits(model, 1)
    seen = {}
    with fastest_attention([model]):
        assert implementations(model) == [STEERED]
        worker = threading.Thread(target=lambda: seen.update(logits=cached_logits(model, 1)))
        worker.start()
        worker.join()
    assert not kernel_choices()
    torch.testing.assert_close(seen["logits"], expected, rtol=0, atol=0)


def test_the_last_of_concurrent_calls_switches_the_model_back():
    model = tiny_causal_lm("llama", seed=0)
    entered, leave_first, first_left, leave_second = (threading.Event() for _ in range(4))
    seen = {}

    def first() -> None:
        with fastest_attention([model]):
            entered.set()
            leave_first.wait()
        first_left.set()

    def second() -> None:
        entered.wait()
        with fastest_attention([model]):
            leave_first.set()
            first_left.wait()
            seen["after the first left"] = implementations(model)
            leave_second.wait()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_left.wait()
    leave_second.set()
    for thread in threads:
        thread.join()
    assert seen["after the first left"] == [STEERED]
    assert implementations(model) == ["sdpa"] and not attention._switched


def test_prefill_and_maskless_blocks_stay_on_sdpa(always):
    """Long queries are SDPA's ground, and a block without a mask is causal only through SDPA's is_causal."""
    model = tiny_causal_lm("llama", seed=0)
    always("eager")
    with fastest_attention([model]), torch.no_grad():
        model(prompt_ids(), use_cache=False)
    assert not kernel_choices()
    with fastest_attention([model]), torch.no_grad():
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


def test_the_kernel_choice_is_a_bench_lever():
    from viasd_hf.bench.methods import STEERED_REFERENCE, MethodName

    assert MethodName.parse("viasd_lossless_reproducible").ablations == ("_reproducible",)
    assert MethodName.parse(STEERED_REFERENCE).base == STEERED_REFERENCE
    assert MethodName.parse(STEERED_REFERENCE + "_reproducible") is None, "ablations are ours only"


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
    with fastest_attention([model]):
        steered = cached_logits(model, rows=3)
    assert torch.equal(steered, cached_logits(model, rows=3))
    assert "eager" not in kernel_choices().values()
