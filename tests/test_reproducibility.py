"""Seeded runs are reproducible: ``torch.manual_seed(s)`` before ``generate`` fixes the output.

Two things used to break that. The adaptive controller decided on wall-clock timings, remembered
across calls, whether the slim tier ran, and that choice changes tiered output and sampled output;
and every draw came from torch's global generator, so anything else drawing from it (another
thread) or a different number of draws earlier in the call shifted the rest. Here the clock is
made to lie wildly, the controller state carries over between calls, and another thread draws
from the global generator mid-call: identically seeded calls must still agree.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd

PROMPT = torch.tensor([[3, 17, 5, 3, 17, 5, 9, 3, 17, 40, 41, 3]])  # repeats, so prompt lookup drafts

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models():
    target = enable_viasd(tiny_causal_lm("llama", seed=0))
    drafter = tiny_causal_lm("llama", seed=7, num_hidden_layers=2)
    return target, drafter, RoutingMask.from_model(target, skip=[2, 3])


@pytest.fixture
def lying_clock(monkeypatch):
    """``time.perf_counter`` advancing by wildly random steps (1 µs to 0.1 s), differently in every run."""
    noise = random.Random()  # seeded from the OS: no two runs see the same timings
    now = [time.perf_counter()]

    def perf_counter() -> float:
        now[0] += noise.choice([1e-6, 1e-4, 1e-2, 1e-1])
        return now[0]

    monkeypatch.setattr(time, "perf_counter", perf_counter)


def generate(models, seed: int, drafting: str, config: dict, stats: list | None = None, **kwargs) -> list[int]:
    """The new tokens of one seeded call; its ``viasd_stats`` are appended to ``stats`` when given."""
    target, drafter, mask = models
    if drafting == "assistant":
        kwargs["assistant_model"] = drafter
    elif drafting == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    else:
        config = config | {"self_draft_mask": RoutingMask.from_model(target, skip=[1, 2, 3, 4])}
    torch.manual_seed(seed)
    out = target.generate(PROMPT, viasd_config=ViaSDConfig.paper(routing_mask=mask, **config), max_new_tokens=24,
                          pad_token_id=0, return_dict_in_generate=True, **kwargs)
    if stats is not None:
        stats.append(out.viasd_stats)
    return out.sequences[0, PROMPT.shape[1]:].tolist()


SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 40}
GREEDY = {"do_sample": False}
CASES = {
    "lossless-sampling": ({"mode": "lossless"}, SAMPLING),
    "tiered-sampling": ({"mode": "tiered"}, SAMPLING),
    "tiered-greedy": ({"mode": "tiered"}, GREEDY),
    "tiered-greedy-fixed": ({"mode": "tiered", "reproducible": True}, GREEDY),
    "lossless-sampling-fixed": ({"mode": "lossless", "reproducible": True}, SAMPLING),
    "lossless-sampling-slim-always-on": ({"mode": "lossless", "adaptive": False}, SAMPLING),
    "cascade-sampling": ({"mode": "tiered", "cascade_lenience": 0.3}, SAMPLING),
}


@pytest.mark.parametrize("drafting", ["assistant", "prompt_lookup", "self"])
@pytest.mark.parametrize("case", CASES)
def test_ten_identically_seeded_calls_give_one_text(models, lying_clock, case, drafting):
    """Default settings (and the explicit reproducible ones) under timings that would flip a wall-clock controller."""
    config, sampling = CASES[case]
    stats = []
    texts = {tuple(generate(models, 11, drafting, config, stats, **sampling)) for _ in range(10)}
    assert len(texts) == 1, f"{len(texts)} different texts from one seed"
    assert all(call.blocks and call.drafted_tokens for call in stats), "every call speculated: drafts were verified"
    assert len({(call.drafted_tokens, call.accepted_tokens, call.blocks) for call in stats}) == 1, "and alike"


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_the_seed_decides_the_sampled_text(models, mode):
    """A sanity check on the test above: sampling does sample, so one text from one seed means something."""
    stats = []
    texts = {tuple(generate(models, seed, "assistant", {"mode": mode}, stats, **SAMPLING)) for seed in range(4)}
    assert len(texts) == 4
    assert all(call.drafted_tokens and call.accepted_tokens for call in stats), "the assistant's drafts were kept"
    assert any(call.accepted_tokens < call.drafted_tokens for call in stats), "and rejected: the seed drew both"


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_a_call_draws_from_the_global_generator_only_for_its_seed(models, mode):
    """How much a call samples does not show in torch's global generator: it takes its seed from it, nothing more."""
    states = []
    for max_new_tokens in (2, 24):
        torch.manual_seed(5)
        models[0].generate(PROMPT, assistant_model=models[1], viasd_config=ViaSDConfig(routing_mask=models[2], mode=mode),
                           max_new_tokens=max_new_tokens, pad_token_id=0, **SAMPLING)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])


class WakeOnFirstCall(LogitsProcessor):
    """Lets a thread start drawing from the global generator once the call is under way, and waits for its first draw."""

    def __init__(self, started: threading.Event, drew: threading.Event) -> None:
        self.started, self.drew = started, drew

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.started.is_set():
            self.started.set()
            assert self.drew.wait(10), "the other thread never drew"
        return scores


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_another_thread_drawing_from_the_global_generator_does_not_change_a_seeded_call(models, mode):
    config = {"mode": mode}
    reference = generate(models, 3, "assistant", config, **SAMPLING)
    started, drew, stop = threading.Event(), threading.Event(), threading.Event()

    def draw_until_stopped() -> None:
        started.wait(10)
        while not stop.is_set():
            torch.rand(4)
            drew.set()
            time.sleep(1e-4)

    other = threading.Thread(target=draw_until_stopped)
    other.start()
    try:
        processors = LogitsProcessorList([WakeOnFirstCall(started, drew)])
        text = generate(models, 3, "assistant", config, logits_processor=processors, **SAMPLING)
    finally:
        stop.set()
        started.set()
        other.join()
    assert text == reference
