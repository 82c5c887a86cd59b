"""Lossless VIA-SD on real checkpoints: token-identical to ``generate`` (fp32) up to numerical near-ties."""

from __future__ import annotations

import pytest
import torch

from conftest import NEAR_TIE_REPORT, assert_stats_consistent, first_near_tie, zoo
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.data.tasks import load_examples

pytestmark = pytest.mark.integration

MAX_NEW = 32
# writing, roleplay, reasoning: MT-Bench lists its categories in blocks of ten
FIRST_OF_EACH_MT_BENCH_CATEGORY = [e.prompt for e in load_examples("mt_bench")[:30:10]]


def chat(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def assert_equal_up_to_near_tie(label: str, ours: torch.Tensor, reference) -> None:
    prompt_length = reference.sequences.shape[1] - len(reference.logits)
    expected = reference.sequences[0, prompt_length:]
    generated = ours[0, prompt_length:]
    tie = first_near_tie(reference.logits)
    if tie is None or torch.equal(generated, expected):
        assert torch.equal(generated, expected), label
        return
    NEAR_TIE_REPORT.append(f"{label}: compared the first {tie} of {len(expected)} tokens (near-tie at {tie})")
    assert torch.equal(generated[:tie], expected[:tie]), label


def reference_greedy(model, ids):
    return model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("prompt_index", range(3))
@pytest.mark.parametrize("drafter_kind", ["self", "prompt_lookup"])
def test_smollm2_lossless_equals_generate(drafter_kind, prompt_index):
    model, tokenizer = zoo("smollm2-135m-instruct")
    enable_viasd(model)
    ids = chat(tokenizer, FIRST_OF_EACH_MT_BENCH_CATEGORY[prompt_index])
    reference = reference_greedy(model, ids)
    config = ViaSDConfig.paper(
        routing_mask=RoutingMask.from_model(model, skip=[3]),
        self_draft_mask=RoutingMask.from_model(model, skip=[3, 5, 9, 12]),
        mode="lossless", adaptive=False)
    extra = {"prompt_lookup_num_tokens": 5} if drafter_kind == "prompt_lookup" else {}
    out = model.generate(ids, viasd_config=config, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True,
                         **extra)
    assert_equal_up_to_near_tie(f"smollm2/{drafter_kind}/prompt{prompt_index}", out.sequences, reference)
    stats = out.viasd_stats
    new_tokens = out.sequences.shape[1] - ids.shape[1]
    assert_stats_consistent(stats, new_tokens, "lossless", stopped_inside_block=new_tokens < MAX_NEW)
    assert stats.slim_forwards > 0
    if drafter_kind == "self":  # the model itself with 4 of its 30 layers skipped drafts, one forward per token
        assert stats.drafter_forwards == stats.drafted_tokens > 0
        assert stats.accepted_tokens >= stats.drafted_tokens / 2, "a drafter this close to the target is mostly right"


@pytest.mark.parametrize("prompt_index", range(2))
@pytest.mark.xdist_group("qwen-pair")  # one worker loads the pair (tests/test_batch.py uses it too)
def test_qwen_coder_pair_lossless_equals_generate(prompt_index):
    target, tokenizer = zoo("qwen2.5-coder-1.5b-instruct")
    drafter, _ = zoo("qwen2.5-coder-0.5b-instruct")
    enable_viasd(target)
    prompts = ["Write a Python function that reverses a string.", load_examples("mt_bench", limit=1)[0].prompt]
    ids = chat(tokenizer, prompts[prompt_index])
    reference = reference_greedy(target, ids)
    mask = RoutingMask.from_model(target, skip=[4, 8, 12], drafter_id="qwen2.5-coder-0.5b-instruct")
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False)
    out = target.generate(ids, assistant_model=drafter, viasd_config=config, max_new_tokens=MAX_NEW, do_sample=False,
                          return_dict_in_generate=True)
    assert_equal_up_to_near_tie(f"qwen-pair/prompt{prompt_index}", out.sequences, reference)
    assert out.viasd_stats.accepted_tokens > 0


def test_stop_strings_with_a_real_tokenizer():
    model, tokenizer = zoo("smollm2-135m-instruct")
    enable_viasd(model)
    ids = chat(tokenizer, "Write a Python function that reverses a string.")
    free = tokenizer.decode(model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)[0, ids.shape[1]:])
    stop = "def"
    assert stop in free
    expected = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                         prompt_lookup_num_tokens=4,
                         viasd_config=ViaSDConfig.paper(routing_mask=RoutingMask.from_model(model, skip=[3]), mode="lossless",
                                                  adaptive=False))
    assert torch.equal(out, expected)
    assert tokenizer.decode(out[0, ids.shape[1]:]).endswith(stop)
