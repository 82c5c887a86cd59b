"""Every logits processor and warper of ``generate`` in a VIA-SD batch: each row is processed in its own place of the
batch, so processors holding one entry per row (``repetition_penalty``'s padding lengths, ``encoder_repetition_penalty``'s
prompts, ``prefix_allowed_tokens_fn``'s batch index) see that row's entry, and lossless greedy output over a left-padded
batch equals ``generate``'s batched greedy output with the same processors."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from conftest import VOCAB, left_padded, random_prompts
from viasd_hf import RoutingMask, ViaSDConfig
from viasd_hf.engine.processors import RowProcessors

PAD, EOS = 0, 7
LENGTHS = (11, 6, 9)


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models run fastest on one thread


def by_row(batch_id: int, sequence: torch.Tensor) -> list[int]:
    """``prefix_allowed_tokens_fn`` that allows each row of the batch a different third of the vocabulary (and EOS)."""
    return [token for token in range(VOCAB) if token % 3 != batch_id % 3] + [EOS]


# generate's built-in processors, each as a user asks for it; a prompt of the batch is padded, so processors that hold
# one entry per row get different entries
BUILT_IN = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [9, 10]]),
    "sequence_bias": dict(sequence_bias={(11,): 3.0, (12, 13): -4.0}),
    "min_length": dict(min_length=max(n // 2 * 3 for n in LENGTHS) + 8, eos_token_id=EOS),  # 8 new tokens
    "min_new_tokens": dict(min_new_tokens=8, eos_token_id=EOS),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=by_row),
    "forced_bos_token_id": dict(forced_bos_token_id=3),
    "forced_eos_token_id": dict(forced_eos_token_id=EOS),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(4, 1.3), eos_token_id=EOS),
    "suppress_tokens": dict(suppress_tokens=[4, 6, 8]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[4, 6, 8]),
    "remove_invalid_values": dict(remove_invalid_values=True),
    "renormalize_logits": dict(renormalize_logits=True),
}
ALL_AT_ONCE = {key: value for options in BUILT_IN.values() for key, value in options.items()}
# those that leave every row a choice at every step (min_new_tokens with forced_eos_token_id would not) and a real
# number for every token (exponential_decay_length_penalty adds +inf to an EOS another processor set to -inf)
SAMPLED = {key: value for key, value in ALL_AT_ONCE.items()
           if key not in ("min_new_tokens", "forced_eos_token_id", "exponential_decay_length_penalty")}
DRAFTERS = {
    "assistant": lambda assistant: dict(assistant_model=assistant),
    "prompt_lookup": lambda assistant: dict(prompt_lookup_num_tokens=3),
    "hybrid": lambda assistant: dict(assistant_model=assistant, prompt_lookup_num_tokens=3),
    "self": lambda assistant: {},
}


def config_for(target) -> ViaSDConfig:
    """Lossless VIA-SD with the slim tier on every block and a self-drafter, so every tier scores with the processors."""
    return ViaSDConfig.paper(mode="lossless", routing_mask=RoutingMask.from_model(target, skip=[2]),
                             self_draft_mask=RoutingMask.from_model(target, skip=[1, 2]), adaptive=False)


def assert_batch_equals_generates(target, assistant, options: dict, drafter: str, seed: int = 0) -> None:
    ids, mask = left_padded(random_prompts(seed, LENGTHS, repeat=True))
    common = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD) | options
    reference = target.generate(ids, viasd_config=None, **common)
    out = target.generate(ids, viasd_config=config_for(target), viasd_check_invariants=True,
                          return_dict_in_generate=True, **common | DRAFTERS[drafter](assistant))
    assert torch.equal(out.sequences, reference)
    copies_only = drafter == "prompt_lookup" and "no_repeat_ngram_size" in options  # which forbids every copy
    assert out.viasd_stats.drafted_tokens > 0 or copies_only


@pytest.mark.parametrize("processor", BUILT_IN)
def test_each_built_in_processor_in_a_batch_equals_generates_batch(near_pair, processor):
    assert_batch_equals_generates(*near_pair, BUILT_IN[processor], "hybrid")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_built_in_processor_at_once_in_a_batch_equals_generates_batch(near_pair, drafter, seed):
    assert_batch_equals_generates(*near_pair, ALL_AT_ONCE, drafter, seed)


def test_sampled_batches_keep_each_rows_own_constraints(near_pair):
    """Sampling with every warper beside the processors: each row draws only what ``prefix_allowed_tokens_fn`` allows
    its own batch index, and never a bad word."""
    target, assistant = near_pair
    ids, mask = left_padded(random_prompts(5, LENGTHS, repeat=True))
    torch.manual_seed(0)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, pad_token_id=PAD,
                          viasd_config=config_for(target), assistant_model=assistant, prompt_lookup_num_tokens=3,
                          temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, typical_p=0.99, epsilon_cutoff=1e-4,
                          eta_cutoff=1e-4, **SAMPLED)
    for row, sequence in enumerate(out[:, ids.shape[1] :].tolist()):
        new = [token for token in sequence if token != PAD]
        assert set(new) <= set(by_row(row, None)), f"row {row} drew a token its prefix_allowed_tokens_fn forbids"
        assert not {5} & set(new)


def processors_of_a_batch(ids: torch.Tensor, padding: list[int]) -> LogitsProcessorList:
    """Built-in processors and warpers as ``generate`` builds them for the batch ``ids``."""
    return LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor(padding)),
        EncoderRepetitionPenaltyLogitsProcessor(1.5, encoder_input_ids=ids[:, :4]),
        NoRepeatNGramLogitsProcessor(2),
        NoBadWordsLogitsProcessor([[5], [9, 10]], eos_token_id=EOS),
        SequenceBiasLogitsProcessor({(11,): 3.0}),
        MinLengthLogitsProcessor(ids.shape[1] + 2, EOS),
        PrefixConstrainedLogitsProcessor(by_row, num_beams=1),
        ExponentialDecayLengthPenalty((2, 1.3), EOS, ids.shape[1]),
        SuppressTokensLogitsProcessor([4, 6]),
        TemperatureLogitsWarper(0.8), TopKLogitsWarper(30), TopPLogitsWarper(0.9), MinPLogitsWarper(0.01),
        TypicalLogitsWarper(0.95), EpsilonLogitsWarper(1e-4), EtaLogitsWarper(1e-4),
    ])  # fmt: skip


def test_a_row_is_processed_as_the_whole_batch_processes_it():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 12), generator=generator)
    padding = [0, 4, 2]
    for row, pad in enumerate(padding):
        ids[row, :pad] = PAD
    scores = torch.randn(3, VOCAB, generator=generator)
    whole = processors_of_a_batch(ids, padding)(ids, scores.clone())
    per_row = RowProcessors(processors_of_a_batch(ids, padding), batch_size=3)
    for row in range(3):
        assert torch.equal(per_row(ids[row : row + 1], scores[row : row + 1].clone(), row), whole[row : row + 1])
