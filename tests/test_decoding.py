"""Three-tier VIA-SD decoding inside ``generate`` on tiny random models (float64: exact, no near-ties)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from conftest import VOCAB, tiny_causal_lm, tiny_t5
from viasd_hf import RoutingMask, ViaSDConfig, ViaSDGenerationMixin, enable_viasd, viasd_generate

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def perturbed_copy(model, scale: float, seed: int):
    """A drafter that mostly agrees with ``model``: the same weights plus noise."""
    drafter = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    drafter.config._name_or_path = f"{model.config._name_or_path}-drafter"
    return drafter


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Prompt lookup only drafts when n-grams repeat."""
    return prompt(seed, 6).repeat(1, 3)


@pytest.fixture(scope="module")
def pair():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return target, perturbed_copy(target, 0.003, seed=1)


@pytest.fixture(scope="module")
def masks(pair):
    target, _ = pair
    return RoutingMask.from_model(target, skip=[2]), RoutingMask.from_model(target, skip=[1, 2, 3])


def viasd(target, ids, config, max_new_tokens=24, **kwargs):
    return target.generate(
        ids, custom_generate=viasd_generate, viasd_config=config, max_new_tokens=max_new_tokens,
        viasd_check_invariants=True, return_dict_in_generate=True, **GREEDY, **kwargs,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("drafter_kind", ["assistant", "self", "prompt_lookup"])
def test_lossless_greedy_equals_generate_for_every_drafter(pair, masks, seed, drafter_kind):
    target, assistant = pair
    slim, heavy = masks
    ids = repetitive_prompt(seed) if drafter_kind == "prompt_lookup" else prompt(seed)
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    config = ViaSDConfig(routing_mask=slim, self_draft_mask=heavy, mode="lossless", tau_accept=0.9, tau_escalate=0.2,
                         adaptive=False)
    extra = {"assistant_model": assistant} if drafter_kind == "assistant" else {}
    extra |= {"prompt_lookup_num_tokens": 4} if drafter_kind == "prompt_lookup" else {}
    if "assistant_model" in extra:
        extra["drafter"] = extra.pop("assistant_model")
    out = viasd(target, ids, config, **extra)
    assert torch.equal(out.sequences, expected)
    assert out.viasd_stats.slim_forwards > 0 and out.viasd_stats.drafted_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_two_tier_equals_hf_assisted_generation(pair, seed):
    target, assistant = pair
    ids = prompt(seed)
    expected = target.generate(ids, assistant_model=assistant, max_new_tokens=24, **GREEDY)
    out = viasd(target, ids, ViaSDConfig(use_slim=False), drafter=assistant)
    assert torch.equal(out.sequences, expected)
    assert out.viasd_stats.slim_forwards == 0
    assert out.viasd_stats.accepted_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_cascade_without_lenience_is_plain_speculative_decoding(pair, seed):
    target, assistant = pair
    ids = prompt(seed)
    expected = target.generate(ids, max_new_tokens=24, **GREEDY)
    out = viasd(target, ids, ViaSDConfig(use_slim=False, cascade_lenience=0.0), drafter=assistant)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("seed", range(4))
def test_cascade_keeps_only_tokens_within_its_lenience(seed):
    """Every committed token is the full model's argmax or within a factor 1 − α of it, and some are not the argmax."""
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    assistant = tiny_causal_lm("llama", seed=seed + 10, dtype=torch.float64, num_hidden_layers=2)
    ids = prompt(seed)
    out = viasd(target, ids, ViaSDConfig(use_slim=False, cascade_lenience=0.5), drafter=assistant)
    with torch.no_grad():
        probs = target(out.sequences).logits[0, ids.shape[1] - 1 : -1].softmax(-1)
    committed = out.sequences[0, ids.shape[1] :]
    ratios = probs.gather(-1, committed[:, None])[:, 0] / probs.max(-1).values
    assert bool((ratios > 0.5 - 1e-9).all())
    assert bool((ratios < 1).any()), "the lenient rule must have kept some non-argmax draft"
    assert out.viasd_stats.accepted_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_tiered_with_unit_thresholds_equals_lossless(pair, masks, seed):
    target, assistant = pair
    ids = prompt(seed)
    tiered = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], tau_accept=1.0, tau_escalate=1.0), drafter=assistant)
    lossless = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant)
    assert torch.equal(tiered.sequences, lossless.sequences)
    assert tiered.viasd_stats.slim_accepted_tokens == 0


@pytest.mark.parametrize("seed", range(4))
def test_tiered_paper_preset_stats_add_up(pair, masks, seed):
    target, assistant = pair
    out = viasd(target, prompt(seed), ViaSDConfig.paper(routing_mask=masks[0], adaptive=False), drafter=assistant,
                max_new_tokens=40)
    stats = out.viasd_stats
    assert stats.new_tokens == out.sequences.shape[1] - 10 == 40
    assert stats.new_tokens == stats.accepted_tokens + stats.slim_tokens + stats.full_tokens
    assert stats.committed_by == {"drafter": stats.accepted_tokens, "slim": stats.slim_tokens, "full": stats.full_tokens}
    assert stats.drafted_tokens == sum(stats.drafted_at_position)
    assert stats.accepted_tokens == sum(stats.accepted_at_position)
    assert stats.slim_accepted_tokens > 0
    assert stats.slim_forwards <= stats.blocks - stats.catch_up_blocks
    blocks_without_slim = stats.blocks - stats.slim_forwards
    assert stats.full_forwards == stats.prefill_forwards + stats.escalated_blocks + blocks_without_slim
    assert 0.0 <= stats.rejection_rate <= 1.0


def test_slim_backlog_is_bounded(pair, masks):
    target, assistant = pair
    config = ViaSDConfig(routing_mask=masks[0], tau_accept=0.0, tau_escalate=0.0, max_slim_backlog=7, adaptive=False)
    stats = viasd(target, prompt(0), config, drafter=assistant, max_new_tokens=40).viasd_stats
    assert stats.peak_slim_backlog <= 7
    assert stats.catch_up_blocks >= 1
    assert stats.escalated_blocks == 0


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("mode", ["tiered", "lossless"])
def test_streamer_gets_prompt_then_every_committed_token(pair, masks, mode):
    target, assistant = pair
    ids, streamer = prompt(3), RecordingStreamer()
    out = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], mode=mode), drafter=assistant, viasd_streamer=streamer)
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out.sequences[0, 10:].tolist()
    assert streamer.ended


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(pair, masks, max_new_tokens):
    target, assistant = pair
    out = viasd(target, prompt(5), ViaSDConfig.paper(routing_mask=masks[0]), drafter=assistant, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == 10 + max_new_tokens


def test_eos_inside_a_block_stops_there(pair, masks):
    target, assistant = pair
    ids = prompt(2)
    free = target.generate(ids, max_new_tokens=24, **GREEDY)[0, 10:].tolist()
    eos = free[6]
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = target.generate(
        ids, custom_generate=viasd_generate, drafter=assistant, max_new_tokens=24, do_sample=False, eos_token_id=eos,
        pad_token_id=0, viasd_config=ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, expected)
    assert out.sequences[0, -1].item() == eos and out.sequences.shape[1] == 10 + free.index(eos) + 1
    stats = out.viasd_stats
    assert sum(stats.committed_by.values()) == stats.new_tokens == free.index(eos) + 1
    assert stats.accepted_tokens + stats.full_tokens > stats.new_tokens, "the block went on past the EOS"


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria_are_honoured_mid_block(pair, masks):
    target, assistant = pair
    out = viasd(target, prompt(1), ViaSDConfig.paper(routing_mask=masks[0]), drafter=assistant,
                stopping_criteria=StoppingCriteriaList([StopAfter(17)]))
    assert out.sequences.shape[1] == 17


def test_left_padded_prompt_matches_generate(pair, masks):
    target, assistant = pair
    ids = torch.cat([torch.zeros((1, 3), dtype=torch.long), prompt(4)], dim=-1)
    attention_mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 10), dtype=torch.long)], dim=-1)
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=20, **GREEDY)
    out = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                attention_mask=attention_mask, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)


def test_logits_processors_apply_as_in_generate(pair, masks):
    target, assistant = pair
    ids = prompt(6)
    expected = target.generate(ids, max_new_tokens=20, repetition_penalty=1.8, no_repeat_ngram_size=2, **GREEDY)
    out = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                max_new_tokens=20, repetition_penalty=1.8, no_repeat_ngram_size=2)
    assert torch.equal(out.sequences, expected)


def test_output_scores_match_generate(pair, masks):
    target, assistant = pair
    ids = prompt(7)
    expected = target.generate(ids, max_new_tokens=12, output_scores=True, return_dict_in_generate=True, **GREEDY)
    out = viasd(target, ids, ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False), drafter=assistant,
                max_new_tokens=12, output_scores=True)
    assert len(out.scores) == len(expected.scores) == 12
    for ours, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)


def test_enable_viasd_routes_viasd_config_and_leaves_plain_generate_alone(masks):
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    assistant = perturbed_copy(target, 0.003, seed=1)
    ids = prompt(8)
    before = target.generate(ids, max_new_tokens=16, **GREEDY)
    with pytest.raises(ValueError, match="viasd_config"):
        target.generate(ids, max_new_tokens=4, viasd_config=ViaSDConfig(routing_mask=masks[0]), **GREEDY)
    enable_viasd(target)
    assert isinstance(target, ViaSDGenerationMixin)
    assert torch.equal(target.generate(ids, max_new_tokens=16, **GREEDY), before)
    config = ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False)
    out = target.generate(ids, assistant_model=assistant, viasd_config=config, max_new_tokens=16,
                          return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, before)
    assert out.viasd_stats.drafter_forwards > 0


def test_mixin_on_a_model_class(masks):
    from transformers import LlamaForCausalLM

    class ViaSDLlama(ViaSDGenerationMixin, LlamaForCausalLM):
        pass

    plain = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    model = ViaSDLlama(plain.config).to(torch.float64).eval()
    model.load_state_dict(plain.state_dict())
    ids = prompt(9)
    out = model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=12,
                         viasd_config=ViaSDConfig(routing_mask=masks[0], mode="lossless", adaptive=False), **GREEDY)
    assert torch.equal(out, plain.generate(ids, max_new_tokens=12, **GREEDY))


def test_clear_errors_for_unsupported_requests(pair, masks):
    target, assistant = pair
    config = ViaSDConfig(routing_mask=masks[0])
    with pytest.raises(ValueError, match="batch of 2"):
        viasd(target, torch.cat([prompt(0), prompt(1)]), config, drafter=assistant)
    other_vocab = tiny_causal_lm("llama", seed=1, dtype=torch.float64, vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match="shares the target's tokenizer"):
        viasd(target, prompt(0), config, drafter=other_vocab)
    t5 = tiny_t5()
    with pytest.raises(ValueError, match="assistant model for an encoder-decoder target"):
        t5.generate(prompt(0), custom_generate=viasd_generate, viasd_config=ViaSDConfig(), drafter=tiny_t5(seed=1),
                    max_new_tokens=4)
    with pytest.raises(ValueError, match="tau_accept"):
        ViaSDConfig(tau_accept=0.3, tau_escalate=0.6)
    with pytest.raises(ValueError, match="mode"):
        ViaSDConfig(mode="fast")


def test_config_round_trips_through_save_pretrained(masks, tmp_path):
    config = ViaSDConfig.paper(routing_mask=masks[0], mode="lossless", num_draft_tokens=4)
    config.save_pretrained(tmp_path)
    loaded = ViaSDConfig.from_pretrained(tmp_path)
    assert loaded == config
    assert isinstance(loaded.routing_mask, RoutingMask)


logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def test_bitsandbytes_4bit_target_runs_end_to_end(tmp_path):
    model = tiny_causal_lm("llama", hidden_size=128, intermediate_size=256)
    model.save_pretrained(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    )
    enable_viasd(target)
    ids = prompt(0)
    expected = target.generate(ids, max_new_tokens=12, **GREEDY)
    mask = RoutingMask.from_model(target, skip=[2])
    out = target.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=12, return_dict_in_generate=True,
                          viasd_config=ViaSDConfig(routing_mask=mask, mode="lossless", adaptive=False), **GREEDY)
    assert out.sequences.shape == expected.shape
    assert out.viasd_stats.new_tokens == 12


def test_peft_target_runs_end_to_end(pair):
    from peft import LoraConfig, get_peft_model

    base, assistant = copy.deepcopy(pair[0]), pair[1]
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    ids = prompt(0)
    expected = peft_model.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
    enable_viasd(peft_model)
    mask = RoutingMask.from_model(peft_model, skip=[2])
    out = peft_model.generate(input_ids=ids, assistant_model=assistant, max_new_tokens=12,
                              viasd_config=ViaSDConfig(routing_mask=mask, mode="lossless", adaptive=False), **GREEDY)
    assert torch.equal(out, expected)


def test_accelerate_offloaded_target_equals_generate(tmp_path):
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(6)}
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                  offload_folder=tmp_path / "offload").eval()
    ids = prompt(11)
    expected = target.generate(ids, max_new_tokens=12, **GREEDY)
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[3]), mode="lossless", adaptive=False)
    out = viasd(target, ids, config, max_new_tokens=12, prompt_lookup_num_tokens=3)
    assert torch.equal(out.sequences, expected)


def test_bfloat16_target_and_drafter_run_end_to_end():
    target = tiny_causal_lm("qwen2", seed=0, dtype=torch.bfloat16)
    assistant = perturbed_copy(target, 0.003, seed=2)
    out = viasd(target, prompt(12), ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[2])),
                drafter=assistant, max_new_tokens=16)
    assert out.viasd_stats.new_tokens == 16


def test_custom_generate_folder_matches_enable_viasd(pair, masks):
    from pathlib import Path

    repo_root = Path(__file__).resolve().parents[1]
    target, assistant = pair
    config = ViaSDConfig.paper(routing_mask=masks[0], adaptive=False)
    ids = prompt(13)
    from_folder = target.generate(ids, custom_generate=str(repo_root), trust_remote_code=True, assistant_model=assistant,
                                  viasd_config=config, max_new_tokens=20, **GREEDY)
    enabled = enable_viasd(copy.deepcopy(target))
    expected = enabled.generate(ids, assistant_model=assistant, viasd_config=config, max_new_tokens=20, **GREEDY)
    assert torch.equal(from_folder, expected)
