"""VIA-SD keeps ``generate``'s semantics: logits processors bind every tier, stopping criteria and
outputs get what ``generate`` gives them, and unsupported or malformed requests fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, StoppingCriteria, StoppingCriteriaList

import viasd_hf.generation as generation
from conftest import VOCAB, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, routed, viasd_generate
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.batch.drafting import BatchDraft
from viasd_hf.engine.batch.lookup import PromptLookupDrafter
from viasd_hf.engine.decisions import forbidden
from viasd_hf.engine.processors import RowProcessors

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
PROMPT_LENGTH = 10


def prompt(seed: int, length: int = PROMPT_LENGTH) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("llama", seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def mask(target):
    return RoutingMask.from_model(target, skip=[2])


@pytest.fixture(scope="module")
def assistant():
    return tiny_causal_lm("llama", seed=3, dtype=torch.float64, num_hidden_layers=2)


def viasd(target, ids, config, max_new_tokens=16, **kwargs):
    options = dict(GREEDY) | kwargs
    return target.generate(ids, custom_generate=viasd_generate, viasd_config=config, max_new_tokens=max_new_tokens,
                           viasd_check_invariants=True, return_dict_in_generate=True, **options)


# -- logits processors bind every tier ------------------------------------------------------------


class ForbiddenDrafter:
    """A batch drafter that ignores the logits processors: wherever they forbid some token, it proposes one."""

    name = "forbidden"
    head = mask = None
    compactions = 0

    def __init__(self, processors: RowProcessors) -> None:
        self.processors = processors
        self.proposed: list[int] = []

    def draft(self, rows, limits, rng, keep_drafting) -> BatchDraft:
        return BatchDraft([self.draft_row(row.ids, limit) for row, limit in zip(rows.active, limits)])

    def draft_row(self, ids, max_tokens) -> Draft:
        sequence, tokens = ids, []
        while len(tokens) < max_tokens:
            banned = forbidden(self.processors(sequence, torch.zeros((1, VOCAB))))[0].nonzero()[:, 0].tolist()
            if not banned:
                break
            token = banned[len(self.proposed) % len(banned)]
            tokens.append(token)
            self.proposed.append(token)
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
        return Draft(tokens=tokens, probs=[None] * len(tokens))

    def unread(self, rows) -> int:
        return 0

    def read(self, rows) -> int:
        return 0

    def commit(self, rows) -> None:
        pass

    def select(self, staying) -> None:
        pass

    def tidy(self) -> None:
        pass


@pytest.fixture
def forbidden_drafter(monkeypatch):
    """Make every VIA-SD call draft with a ``ForbiddenDrafter`` over the processors generate built."""
    made: list[ForbiddenDrafter] = []

    def build(*args, **kwargs):
        processors = next(a for a in [*args, *kwargs.values()] if isinstance(a, RowProcessors))
        made.append(ForbiddenDrafter(processors))
        return made[-1]

    monkeypatch.setattr(generation, "batch_drafter", build)
    return made


def assert_every_token_allowed(sequences: torch.Tensor, processors: LogitsProcessorList) -> None:
    for position in range(PROMPT_LENGTH, sequences.shape[1]):
        token = int(sequences[0, position])
        scores = processors(sequences[:, :position], torch.zeros((1, VOCAB)))
        assert not forbidden(scores)[0, token], f"token {token} at position {position} is forbidden there"


EOS = 7
PROCESSORS = {
    "bad_words_ids": dict(bad_words_ids=[[5], [9]]),
    "suppress_tokens": dict(suppress_tokens=[5, 9, 11]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=list(range(2, 60))),
    "min_new_tokens": dict(min_new_tokens=12, eos_token_id=EOS),
    "min_length": dict(min_length=PROMPT_LENGTH + 12, eos_token_id=EOS),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
}
# Every draft is accepted on raw probabilities (thresholds 0) unless the tier guards the processors.
LENIENT = {
    "slim tier": lambda mask: ViaSDConfig.paper(mode="tiered", routing_mask=mask, tau_accept=0.0, tau_escalate=0.0, adaptive=False),
    "cascade": lambda mask: ViaSDConfig.paper(mode="tiered", use_slim=False, cascade_lenience=0.999),
}


@pytest.mark.parametrize("path", LENIENT)
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("processor", PROCESSORS)
def test_tiered_mode_never_commits_a_token_the_processors_forbid(target, mask, forbidden_drafter, processor, do_sample,
                                                                 path):
    torch.manual_seed(0)
    options = GREEDY | PROCESSORS[processor] | ({"do_sample": True, "temperature": 1.0} if do_sample else {})
    out = viasd(target, prompt(1), LENIENT[path](mask), max_new_tokens=16, **options)
    drafter = forbidden_drafter[-1]
    assert drafter.proposed, "the drafter must have proposed forbidden tokens for the test to mean anything"
    assert_every_token_allowed(out.sequences, drafter.processors)
    assert out.viasd_stats.drafted_tokens > 0
    if path == "slim tier":  # a forbidden draft has confidence 0: the full model decides
        assert out.viasd_stats.escalated_blocks > 0
    if "eos_token_id" in PROCESSORS[processor]:
        assert EOS not in out.sequences[0, PROMPT_LENGTH : PROMPT_LENGTH + 12].tolist()


def repetitive_prompt(seed: int) -> torch.Tensor:
    return prompt(seed, 5).repeat(1, 2)


def test_prompt_lookup_cuts_its_draft_before_a_forbidden_token():
    ids = torch.tensor([[11, 12, 13, 14, 11, 12]])
    assert PromptLookupDrafter(4).draft(ids, 4).tokens == [13, 14, 11, 12]
    no_repeat = LogitsProcessorList([NoRepeatNGramLogitsProcessor(3)])
    # (11, 12, 13) was seen: 13 is forbidden after 11 12, so every match yields nothing
    assert PromptLookupDrafter(4, RowProcessors(no_repeat), VOCAB).draft(ids, 4).tokens == []
    ids = torch.tensor([[11, 12, 13, 14, 20, 12]])
    # copies 13 14 20 12 after the 12: (20, 12, 13) is new, (12, 13, 14) was seen, so 14 is cut
    assert PromptLookupDrafter(4, RowProcessors(no_repeat), VOCAB).draft(ids, 4).tokens == [13]


@pytest.mark.parametrize("seed", range(3))
def test_prompt_lookup_in_tiered_mode_respects_no_repeat_ngram_size(target, mask, seed):
    config = ViaSDConfig.paper(mode="tiered", routing_mask=mask, tau_accept=0.0, tau_escalate=0.0, adaptive=False)
    out = viasd(target, repetitive_prompt(seed), config, max_new_tokens=16, prompt_lookup_num_tokens=4,
                no_repeat_ngram_size=2)
    sequence = out.sequences[0].tolist()
    for t in range(PROMPT_LENGTH, len(sequence)):
        earlier = {tuple(sequence[i : i + 2]) for i in range(t - 1)}
        assert tuple(sequence[t - 1 : t + 1]) not in earlier, f"bigram {sequence[t - 1 : t + 1]} repeated at {t}"


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_prompt_lookup_in_tiered_mode_respects_bad_words(target, mask, do_sample):
    ids = repetitive_prompt(4)
    banned = [[int(ids[0, 2])], [int(ids[0, 3])]]  # the lookup copies these
    config = ViaSDConfig.paper(mode="tiered", routing_mask=mask, tau_accept=0.0, tau_escalate=0.0, adaptive=False)
    torch.manual_seed(0)
    out = viasd(target, ids, config, max_new_tokens=16, prompt_lookup_num_tokens=4, bad_words_ids=banned,
                do_sample=do_sample)
    new = out.sequences[0, PROMPT_LENGTH:].tolist()
    assert not {banned[0][0], banned[1][0]} & set(new)
    assert out.viasd_stats.drafted_tokens > 0


# -- stopping criteria and outputs ----------------------------------------------------------------


class RecordingCriteria(StoppingCriteria):
    """Stops after ``new`` tokens; records what ``scores`` it was given each time."""

    def __init__(self, new: int) -> None:
        self.new, self.seen = new, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(None if scores is None else (len(scores), scores[-1].clone()))
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT_LENGTH + self.new, dtype=torch.bool)


@pytest.mark.parametrize("output_scores", [True, False])
def test_stopping_criteria_get_the_scores_generate_gives_them(target, mask, output_scores):
    ids = prompt(2)
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False)
    ours, theirs = RecordingCriteria(7), RecordingCriteria(7)
    out = viasd(target, ids, config, max_new_tokens=16, prompt_lookup_num_tokens=3, output_scores=output_scores,
                stopping_criteria=StoppingCriteriaList([ours]))
    expected = target.generate(ids, max_new_tokens=16, output_scores=output_scores, return_dict_in_generate=True,
                               stopping_criteria=StoppingCriteriaList([theirs]), **GREEDY)
    assert torch.equal(out.sequences, expected.sequences) and out.sequences.shape[1] == PROMPT_LENGTH + 7
    assert len(ours.seen) == len(theirs.seen) == 7
    for mine, hf in zip(ours.seen, theirs.seen):
        if not output_scores:
            assert mine is None and hf is None
            continue
        assert mine[0] == hf[0] and mine[1].shape == hf[1].shape == (1, VOCAB)
        torch.testing.assert_close(mine[1], hf[1], atol=1e-5, rtol=0)


def test_confidence_criteria_reading_scores_works_as_in_generate(target, mask):
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    ids = prompt(3)
    plain = target.generate(ids, max_new_tokens=16, output_scores=True, return_dict_in_generate=True, **GREEDY)
    probs = [row.softmax(-1)[0, token].item() for row, token in zip(plain.scores, plain.sequences[0, PROMPT_LENGTH:])]
    threshold = (sorted(probs[:8])[0] + sorted(probs[:8])[1]) / 2  # stops inside the first 8 tokens
    criteria = StoppingCriteriaList([ConfidenceCriteria(threshold)])
    expected = target.generate(ids, max_new_tokens=16, output_scores=True, return_dict_in_generate=True,
                               stopping_criteria=criteria, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False), max_new_tokens=16,
                prompt_lookup_num_tokens=3, output_scores=True, stopping_criteria=criteria)
    assert torch.equal(out.sequences, expected.sequences)
    assert out.sequences.shape[1] < PROMPT_LENGTH + 16


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_output_logits_are_the_raw_logits_of_each_committed_token(target, mask, assistant, mode):
    ids = prompt(4)
    expected = target.generate(ids, max_new_tokens=12, output_logits=True, return_dict_in_generate=True, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=mask, mode=mode, adaptive=False), max_new_tokens=12,
                drafter=assistant, output_logits=True)
    assert out.logits is not None and len(out.logits) == 12
    assert all(row.shape == (1, VOCAB) and row.dtype == torch.float32 for row in out.logits)
    if mode == "lossless":
        assert torch.equal(out.sequences, expected.sequences)
        for ours, theirs in zip(out.logits, expected.logits):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    else:  # a row is the logits of the tier that saw the position: a token that tier chose is its argmax
        chosen_by_a_tier = out.viasd_stats.committed_by["slim"] + out.viasd_stats.committed_by["full"]
        assert out.viasd_stats.committed_by["slim"] > 0
        matches = sum(row.argmax(-1).item() == token for row, token in zip(out.logits, out.sequences[0, 10:].tolist()))
        assert matches >= chosen_by_a_tier


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_attentions_and_hidden_states_are_refused_not_returned_as_none(target, mask, flag):
    with pytest.raises(ValueError, match=flag):
        viasd(target, prompt(0), ViaSDConfig(mode="tiered", routing_mask=mask), prompt_lookup_num_tokens=3, **{flag: True})


# -- requests VIA-SD refuses, named as the user made them -----------------------------------------


def test_beams_are_named_and_sampled_copies_of_a_prompt_decode_as_a_batch(target, mask, assistant):
    config = ViaSDConfig(mode="tiered", routing_mask=mask)
    with pytest.raises(ValueError, match="num_beams=2"):
        viasd(target, prompt(0), config, drafter=assistant, num_beams=2)
    with pytest.raises(ValueError, match="1 prompt x num_return_sequences=3.*set eos_token_id"):
        viasd(target, prompt(0), config, drafter=assistant, num_return_sequences=3, do_sample=True,
              stopping_criteria=StoppingCriteriaList([RecordingCriteria(4)]))
    out = viasd(target, prompt(0), config, drafter=assistant, num_return_sequences=3, do_sample=True)
    assert out.sequences.shape[0] == 3 and out.viasd_stats.batch_size == 3
    with pytest.raises(ValueError, match="num_return_sequences"):  # generate's own refusal of greedy copies
        viasd(target, prompt(0), config, drafter=assistant, num_return_sequences=3)


@pytest.mark.parametrize("width", [8, 12])
@pytest.mark.parametrize("padded", [False, True])
def test_attention_mask_of_another_length_than_the_prompt_is_refused(target, mask, width, padded):
    attention_mask = torch.ones((1, width), dtype=torch.long)
    if padded:
        attention_mask[0, :2] = 0
    with pytest.raises(ValueError, match=f"attention_mask has {width} positions but input_ids has 10 tokens"):
        viasd(target, prompt(0), ViaSDConfig(mode="tiered", routing_mask=mask), prompt_lookup_num_tokens=3,
              attention_mask=attention_mask)


def test_a_matching_left_padded_attention_mask_still_works(target, mask):
    ids = torch.cat([torch.zeros((1, 2), dtype=torch.long), prompt(5, 8)], dim=-1)
    attention_mask = torch.cat([torch.zeros((1, 2), dtype=torch.long), torch.ones((1, 8), dtype=torch.long)], dim=-1)
    expected = target.generate(ids, attention_mask=attention_mask, max_new_tokens=8, **GREEDY)
    out = viasd(target, ids, ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False), max_new_tokens=8,
                prompt_lookup_num_tokens=3, attention_mask=attention_mask)
    assert torch.equal(out.sequences, expected)


def test_empty_prompt_and_inputs_embeds_only_get_a_clear_error(target, mask):
    config = ViaSDConfig(mode="tiered", routing_mask=mask)
    with pytest.raises(ValueError, match="at least one token"):
        viasd(target, torch.zeros((1, 0), dtype=torch.long), config, prompt_lookup_num_tokens=3)
    embeds = target.get_input_embeddings()(prompt(0))
    for ids in (None, prompt(0)):  # embeddings only, or beside the ids they would silently replace
        with pytest.raises(ValueError, match="inputs_embeds"):
            target.generate(ids, inputs_embeds=embeds, custom_generate=viasd_generate, viasd_config=config,
                            prompt_lookup_num_tokens=3, max_new_tokens=4, **GREEDY)


DRAFTERS = {  # generate options, and the config's self-drafting mask, that pick each drafter
    "assistant": lambda assistant, mask: ({"drafter": assistant}, None),
    "hybrid": lambda assistant, mask: ({"drafter": assistant, "prompt_lookup_num_tokens": 3}, None),
    "prompt lookup": lambda assistant, mask: ({"prompt_lookup_num_tokens": 3}, None),
    "self-drafter": lambda assistant, mask: ({}, mask),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_classifier_free_guidance_is_refused_with_every_drafter(target, mask, assistant, drafter):
    options, self_draft_mask = DRAFTERS[drafter](assistant, RoutingMask.from_model(target, skip=[1, 2, 3]))
    config = ViaSDConfig(routing_mask=mask, mode="lossless", self_draft_mask=self_draft_mask)
    with pytest.raises(ValueError, match=r"classifier-free guidance \(guidance_scale=1.5\).*drop guidance_scale"):
        viasd(target, prompt(0), config, guidance_scale=1.5, **options)
    assert viasd(target, prompt(0), config, max_new_tokens=4, guidance_scale=1.0, **options).viasd_stats.new_tokens == 4


@pytest.mark.parametrize(("tokens", "error", "message"), [
    (-2, ValueError, "must be >= 1 .*got -2"),
    (0, ValueError, "must be >= 1 .*got 0"),
    (2.5, TypeError, "must be a whole number .*got 2.5 \\(float\\)"),
    ("3", TypeError, "must be a whole number .*got '3' \\(str\\)"),
])
def test_prompt_lookup_num_tokens_must_be_a_positive_int(target, mask, tokens, error, message):
    repetitive = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # a lookup finds a match at once
    with pytest.raises(error, match="prompt_lookup_num_tokens " + message):
        viasd(target, repetitive, ViaSDConfig(routing_mask=mask), prompt_lookup_num_tokens=tokens)


def test_assistant_early_exit_is_refused_not_ignored(target, mask, assistant):
    with pytest.raises(ValueError, match=r"assistant_early_exit=2\).*ViaSDConfig\(self_draft_mask=\.\.\.\)"):
        viasd(target, prompt(0), ViaSDConfig(routing_mask=mask), drafter=assistant, assistant_early_exit=2)


def test_viasd_inside_a_users_routed_block_is_refused(target, mask):
    config = ViaSDConfig(routing_mask=mask, mode="lossless")
    with routed(target, RoutingMask.from_model(target, skip=[3, 4])):
        with pytest.raises(ValueError, match=r"inside routed\(model, mask\), which skips decoder layers \[3, 4\]"):
            viasd(target, prompt(0), config, prompt_lookup_num_tokens=3)
    expected = target.generate(prompt(0), max_new_tokens=8, **GREEDY)
    assert torch.equal(viasd(target, prompt(0), config, max_new_tokens=8, prompt_lookup_num_tokens=3).sequences, expected)


# -- ViaSDConfig is checked when generate uses it -------------------------------------------------


@pytest.mark.parametrize(("field", "value", "error"), [
    ("num_draft_tokens", 2.5, TypeError),
    ("num_draft_tokens", True, TypeError),
    ("num_draft_tokens", "5", TypeError),
    ("max_slim_backlog", 16.0, TypeError),
    ("use_slim", "yes", TypeError),
    ("adaptive", 1, TypeError),
    ("tau_accept", "0.7", TypeError),
    ("tau_escalate", None, TypeError),
    ("cascade_lenience", "0.5", TypeError),
    ("draft_confidence_threshold", True, TypeError),
    ("routing_mask", 5, TypeError),
    ("self_draft_mask", ["a"], TypeError),
    ("mode", "bogus", ValueError),
    ("confidence", "vibes", ValueError),
    ("num_draft_tokens", 0, ValueError),
    ("tau_accept", 1.5, ValueError),
])
def test_config_fields_are_checked_at_construction_and_again_at_generate(target, mask, field, value, error):
    with pytest.raises(error, match=field):
        ViaSDConfig.paper(**{"routing_mask": mask, field: value})
    config = ViaSDConfig.paper(mode="tiered", routing_mask=mask, adaptive=False)
    setattr(config.knobs if hasattr(config.knobs, field) else config, field, value)  # changed after construction
    with pytest.raises(error, match=field):
        viasd(target, prompt(0), config, max_new_tokens=4, prompt_lookup_num_tokens=3)
    with pytest.raises(error, match=field):
        config.validate()


@pytest.mark.parametrize("given", [{"mode": "tiered"}, {}, "tiered"])
def test_viasd_config_must_be_a_viasd_config(target, given):
    with pytest.raises(TypeError, match="viasd_config must be a ViaSDConfig"):
        viasd(target, prompt(0), given, max_new_tokens=4, prompt_lookup_num_tokens=3)


def test_config_file_with_a_wrong_type_names_the_field(tmp_path, mask):
    ViaSDConfig(mode="tiered", routing_mask=mask).save_pretrained(tmp_path)
    path = tmp_path / "viasd_config.json"
    path.write_text(path.read_text().replace('"num_draft_tokens": 5', '"num_draft_tokens": "5"'))
    with pytest.raises(TypeError, match="num_draft_tokens"):
        ViaSDConfig.from_pretrained(tmp_path)


def test_a_config_with_paths_saves_them_as_strings(tmp_path, mask):
    mask.save_pretrained(tmp_path / "mask")
    config = ViaSDConfig(routing_mask=tmp_path / "mask", self_draft_mask=tmp_path / "mask", vocabulary=tmp_path / "vocab")
    config.save_pretrained(tmp_path / "config")
    saved = json.loads((tmp_path / "config" / "viasd_config.json").read_text())
    assert saved["routing_mask"] == saved["self_draft_mask"] == str(tmp_path / "mask")
    assert saved["vocabulary"] == str(tmp_path / "vocab")
    assert ViaSDConfig.from_pretrained(tmp_path / "config").routing_mask == str(tmp_path / "mask")
