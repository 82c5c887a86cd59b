"""Full-model agreement (``viasd_hf.bench.runner``): each generated token judged teacher-forced, on its own."""

from __future__ import annotations

import pytest
import torch
from test_bench import outcome

from conftest import tiny_causal_lm, tiny_t5
from viasd_hf.bench.runner import MethodRuns, full_model_agreement, full_model_choices, summarise
from viasd_hf.data.tasks import Example

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = torch.tensor([[3, 17, 5, 3, 17, 5, 3, 17]])


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", seed=0)


def greedy_tokens(model, count: int = 10) -> list[int]:
    output = model.generate(PROMPT, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0)
    return output[0, PROMPT.shape[1]:].tolist()


def test_greedy_output_is_the_full_models_choice_everywhere(model):
    tokens = greedy_tokens(model)
    assert full_model_choices(model, PROMPT, tokens) == len(tokens)
    assert full_model_choices(model, PROMPT, []) == 0


def test_each_token_is_judged_after_the_methods_own_prefix(model):
    tokens = greedy_tokens(model)
    wrong = (tokens[4] + 1) % model.config.vocab_size
    assert full_model_choices(model, PROMPT, tokens[:4] + [wrong]) == 4  # only the changed token is off
    # after a token the full model would not have chosen, its choices follow that prefix, not greedy's output
    diverged = tokens[:4] + [wrong]
    continuation = greedy_tokens_after(model, diverged, 5)
    assert full_model_choices(model, PROMPT, diverged + continuation) == len(diverged + continuation) - 1


def greedy_tokens_after(model, prefix: list[int], count: int) -> list[int]:
    ids = torch.cat([PROMPT, torch.tensor([prefix])], dim=-1)
    output = model.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0)
    return output[0, ids.shape[1]:].tolist()


def test_each_distinct_output_costs_one_pass(model, monkeypatch):
    tokens = greedy_tokens(model)
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    counts = full_model_agreement(model, [PROMPT, PROMPT], {"greedy": [tokens, tokens[:3]], "fast": [tokens, tokens[:3]],
                                                            "lossy": [tokens[:2] + [tokens[2] + 1], tokens[:3]]})
    assert counts == {"greedy": [10, 3], "fast": [10, 3], "lossy": [2, 3]}
    assert len(calls) == 3


def test_encoder_decoder_targets_are_refused():
    with pytest.raises(ValueError, match="decoder-only"):
        full_model_agreement(tiny_t5(), [PROMPT], {"greedy": [[1, 2]]})


def test_summary_pools_the_agreed_tokens_per_task_and_overall():
    examples = [Example("qa", "q1", ["paris"]), Example("qa", "q2", ["rome"]), Example("custom", "x")]
    greedy = MethodRuns([outcome([1, 2, 3, 4], 4.0, 4), outcome([5, 6], 1.0, 2), outcome([7, 8], 2.0, 2)], [[4.0], [1.0], [2.0]])
    tiered = MethodRuns([outcome([1, 2, 3, 9], 2.0, 2), outcome([5, 6], 0.5, 1), outcome([7, 9], 1.0, 1)], [[2.0], [0.5], [1.0]])
    summary = summarise({"greedy": greedy, "tiered": tiered}, examples, lambda t: " ".join(map(str, t)),
                        {"greedy": 1, "tiered": 1}, {"greedy": [4, 2, 2], "tiered": [3, 2, 1]})
    assert summary["tiered"]["quality"]["full_model_agreement"] == pytest.approx(6 / 8)
    assert summary["tiered"]["per_task"]["qa"]["quality"]["full_model_agreement"] == pytest.approx(5 / 6)
    assert summary["tiered"]["per_task"]["custom"]["quality"]["full_model_agreement"] == pytest.approx(1 / 2)
    assert summary["greedy"]["quality"]["full_model_agreement"] == 1.0
    unmeasured = summarise({"greedy": greedy}, examples, lambda t: "", {"greedy": 1})
    assert "full_model_agreement" not in unmeasured["greedy"]["quality"]
