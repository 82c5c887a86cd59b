"""``enable_viasd`` is a drop-in: the model's class, saved files, pickling, copies and plain ``generate`` stay as
they were, and the ``custom_generate=viasd_generate`` path uses the drafter and streamer it is given."""

from __future__ import annotations

import copy
import functools
import io
import json
import pickle

import pytest
import torch

from conftest import VOCAB, RecordingStreamer, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, ViaSDGenerationMixin, disable_viasd, enable_viasd, viasd_generate
from viasd_hf.masks.architectures import decoder_layers

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


def target_and_assistant():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return target, near_copy(target)


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 10), generator=torch.Generator().manual_seed(seed))


def lossless(model) -> ViaSDConfig:
    return ViaSDConfig.paper(routing_mask=RoutingMask.from_model(model, skip=[2]),
                       self_draft_mask=RoutingMask.from_model(model, skip=[1, 2, 3]), mode="lossless", adaptive=False)


def forward_counter(model) -> list[int]:
    """A counter of ``model``'s top-level forward calls."""
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_enable_viasd_leaves_the_class_alone():
    model = tiny_causal_lm("llama")
    cls = type(model)
    enable_viasd(model)
    assert type(model) is cls
    assert not isinstance(model, ViaSDGenerationMixin)


def test_save_pretrained_writes_the_same_files(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "before")
    enable_viasd(model, lossless(model))
    model.save_pretrained(tmp_path / "after")
    before = json.loads((tmp_path / "before" / "config.json").read_text())
    after = json.loads((tmp_path / "after" / "config.json").read_text())
    assert after == before and after["architectures"] == ["LlamaForCausalLM"]
    names = sorted(p.name for p in (tmp_path / "before").iterdir())
    assert sorted(p.name for p in (tmp_path / "after").iterdir()) == names
    for saved in (tmp_path / "before").iterdir():
        assert (tmp_path / "after" / saved.name).read_bytes() == saved.read_bytes(), saved.name


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_an_enabled_model_pickles_and_the_loaded_one_drives_itself(how):
    model = tiny_causal_lm("llama", dtype=torch.float64)
    ids = prompt()
    expected = model.generate(ids, max_new_tokens=10, **GREEDY)
    enable_viasd(model)
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is type(model)
    assert loaded.generate.keywords["model"] is loaded
    calls = forward_counter(loaded)
    out = loaded.generate(ids, viasd_config=lossless(loaded), max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected) and out.viasd_stats.slim_forwards > 0 and calls[0] > 0
    assert torch.equal(loaded.generate(ids, max_new_tokens=10, **GREEDY), expected)


def test_a_deep_copy_is_independent_and_its_generate_drives_the_copy():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    enable_viasd(model)
    twin = copy.deepcopy(model)
    original_calls, twin_calls = forward_counter(model), forward_counter(twin)
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1)  # the copy's own weights: its greedy output changes
    ids = prompt(1)
    expected = twin.generate(ids, max_new_tokens=10, **GREEDY)
    assert original_calls[0] == 0 and twin_calls[0] > 0
    out = twin.generate(ids, viasd_config=lossless(twin), max_new_tokens=10, **GREEDY)
    assert torch.equal(out, expected)
    assert original_calls[0] == 0
    assert not torch.equal(model.generate(ids, max_new_tokens=10, **GREEDY), expected)


def test_plain_generate_is_unchanged_and_disable_viasd_restores_generate():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    ids = prompt(2)
    before = model.generate(ids, max_new_tokens=12, output_scores=True, return_dict_in_generate=True, **GREEDY)
    enable_viasd(model)
    after = model.generate(ids, max_new_tokens=12, output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert type(after) is type(before) and torch.equal(after.sequences, before.sequences)
    assert all(torch.equal(a, b) for a, b in zip(after.scores, before.scores))
    disable_viasd(model)
    assert "generate" not in vars(model)
    with pytest.raises(ValueError, match="viasd_config"):
        model.generate(ids, max_new_tokens=2, viasd_config=lossless(model), **GREEDY)


def test_disable_viasd_restores_a_generate_bound_on_the_instance():
    """transformers binds a Hub ``custom_generate`` on the instance; enabling and disabling VIA-SD keeps it."""
    model = tiny_causal_lm("llama")

    def hub_generate(*args, model, **kwargs):
        return "from the hub"

    model.generate = functools.partial(hub_generate, model=model)
    enable_viasd(model)
    enable_viasd(model)
    assert model.generate(prompt()) == "from the hub"
    disable_viasd(model)
    assert model.generate.func is hub_generate


def test_a_default_config_makes_plain_calls_viasd_and_none_opts_out():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    ids = prompt(3)
    expected = model.generate(ids, max_new_tokens=10, **GREEDY)
    enable_viasd(model, lossless(model))
    out = model.generate(ids, max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected) and out.viasd_stats.slim_forwards > 0
    plain = model.generate(ids, viasd_config=None, max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(plain.sequences, expected) and not hasattr(plain, "viasd_stats")


def word_tokenizer():
    """A tokenizer over the tiny models' vocabulary, built offline: token ``i`` is the word ``w{i}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w1")


def test_a_pipeline_runs_viasd_unchanged_with_a_default_config():
    from transformers import pipeline

    model = tiny_causal_lm("llama", dtype=torch.float64)
    model.generation_config.eos_token_id = None
    text = " ".join(f"w{i}" for i in prompt(4)[0].tolist())
    generator = pipeline("text-generation", model=model, tokenizer=word_tokenizer())
    expected = generator(text, max_new_tokens=10, do_sample=False)
    enable_viasd(model, lossless(model))
    slim_calls = [0]
    decoder_layers(model)[2].mlp.register_forward_pre_hook(lambda *_: slim_calls.__setitem__(0, slim_calls[0] + 1))
    full_calls = forward_counter(model)
    assert generator(text, max_new_tokens=10, do_sample=False) == expected
    assert 0 < slim_calls[0] < full_calls[0]  # layer 2 was skipped in some passes: VIA-SD ran


def test_custom_generate_callable_drafts_with_the_drafter_and_streams_to_the_streamer_it_is_given():
    """``generate`` hands a ``custom_generate`` callable neither ``assistant_model`` nor ``streamer``: called directly,
    ``viasd_generate`` takes them as ``drafter`` and ``viasd_streamer``."""
    target, assistant = target_and_assistant()
    ids, streamer = prompt(6), RecordingStreamer()
    expected = target.generate(ids, max_new_tokens=12, **GREEDY)
    assistant_calls = forward_counter(assistant)
    out = target.generate(ids, custom_generate=viasd_generate, drafter=assistant, viasd_streamer=streamer,
                          viasd_config=lossless(target), max_new_tokens=12, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected)
    assert assistant_calls[0] == out.viasd_stats.drafter_forwards > 1, "its reads and drafting passes"
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out.sequences[0, 10:].tolist()
    assert streamer.ended


def test_enable_viasd_on_a_mixin_class_keeps_the_assistant_model():
    from transformers import LlamaForCausalLM

    class ViaSDLlama(ViaSDGenerationMixin, LlamaForCausalLM):
        pass

    target, assistant = target_and_assistant()
    model = ViaSDLlama(target.config).to(torch.float64).eval()
    model.load_state_dict(target.state_dict())
    enable_viasd(model, lossless(model))
    assistant_calls = forward_counter(assistant)
    ids = prompt(7)
    out = model.generate(ids, assistant_model=assistant, max_new_tokens=12, **GREEDY)
    assert torch.equal(out, target.generate(ids, max_new_tokens=12, **GREEDY))
    assert assistant_calls[0] > 0


class _OldKeyword:
    """A model whose forward takes its KV cache as ``past_key_values`` only (transformers before 5.24, or remote code
    written for them): handed ``cache=``, it would run without the cache, silently."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return super().forward(input_ids=input_ids, cache=past_key_values, **kwargs)


def _with_old_keyword(model):
    model.__class__ = type(f"Old{type(model).__name__}", (_OldKeyword, type(model)), {})
    return model


@pytest.mark.parametrize("role", ["the model", "the assistant model"])
def test_a_model_that_takes_no_cache_keyword_is_refused_not_run_without_its_cache(role):
    target, assistant = target_and_assistant()
    _with_old_keyword(target if role == "the model" else assistant)
    enable_viasd(target)
    with pytest.raises(ValueError, match=f"{role} .*takes no `cache` argument.*transformers>=5.24"):
        target.generate(prompt(), assistant_model=assistant, viasd_config=lossless(target), max_new_tokens=4, **GREEDY)
