"""Draft vocabularies: the sliced LM head, lossless and exact decoding over a vocabulary, the slim tier's escalation
of drafts outside it, validation, storage beside the pair's mask (folder, shipped, Hub), and choosing V."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from hub_server import serve
from huggingface_hub import constants
from test_sampling import TV_BOUND, N, exact_two_token_distribution, next_probs, processors, total_variation
from transformers import StoppingCriteriaList

from conftest import VOCAB, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.calibration.vocabulary import choose_size, coverage, rank_tokens
from viasd_hf.engine.batch.drafting import BatchAssistant
from viasd_hf.engine.batch.loop import BatchedDecoder
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.rows import Rows
from viasd_hf.engine.processors import RowProcessors
from viasd_hf.engine.sampling import RandomStream
from viasd_hf.hub import files as hub_files
from viasd_hf.masks import repo as mask_repo
from viasd_hf.masks.architectures import config_fingerprint
from viasd_hf.vocabulary import DraftVocabulary, DraftVocabularyError
from viasd_hf.vocabulary.head import SubsetHead
from viasd_hf.vocabulary.lookup import clear_vocabulary_cache, resolve_vocabulary

pytestmark = pytest.mark.usefixtures("single_thread")

EVEN = list(range(0, VOCAB, 2))  # a vocabulary of half the tokens


def vocabulary_for(model, ids=EVEN, **fields) -> DraftVocabulary:
    rows = model.get_output_embeddings().weight.shape[0]
    return DraftVocabulary(token_ids=list(ids), vocab_size=rows, target_id=model.config._name_or_path,
                           target_fingerprint=config_fingerprint(model), **fields)


@pytest.mark.parametrize("kind, tied", [("llama", False), ("qwen2", True), ("gemma3_text", True)])
def test_the_sliced_head_computes_the_vocabularys_rows_of_the_full_logits(kind, tied):
    """Tied and untied heads; Gemma's final soft-capping applied as the model applies it."""
    model = tiny_causal_lm(kind, tie_word_embeddings=tied)
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    full = model(tokens).logits[0, -3:]
    sliced = SubsetHead(model, EVEN).logits(model, tokens, None, keep=3)
    torch.testing.assert_close(sliced[:, EVEN], full[:, EVEN])
    outside = [t for t in range(VOCAB) if t not in EVEN]
    assert torch.isneginf(sliced[:, outside]).all()


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
@pytest.mark.parametrize("drafting", ["assistant", "self", "prompt_lookup"])
@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_lossless_greedy_over_a_vocabulary_is_token_identical_to_generate(kind, drafting, mode, prompt_ids):
    """The full model keeps its whole head, so lossless output is generate's (tiered mode must merely run; what it
    commits is checked in the next test)."""
    target = enable_viasd(tiny_causal_lm(kind))
    mask = RoutingMask.from_model(target, skip=[1, 4])
    kwargs: dict = {}
    config = ViaSDConfig.paper(routing_mask=mask, mode=mode, adaptive=False, tau_accept=0.3, tau_escalate=0.1,
                         vocabulary=vocabulary_for(target))
    if drafting == "assistant":
        kwargs["assistant_model"] = tiny_causal_lm(kind, seed=3)
    elif drafting == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    else:
        config.self_draft_mask = RoutingMask.from_model(target, skip=[1, 3, 4])
    reference = target.generate(prompt_ids, max_new_tokens=24, do_sample=False, viasd_config=None)
    out = target.generate(prompt_ids, max_new_tokens=24, do_sample=False, viasd_config=config,
                          viasd_check_invariants=True, return_dict_in_generate=True, **kwargs)
    if mode == "lossless":
        assert torch.equal(out.sequences, reference)
    assert out.viasd_stats.slim_forwards > 0


class RecordingDecoder(BatchedDecoder):
    """Records who made every committed token of its one row."""

    def commit(self, blocks, draft, catch_up=False):
        self.made = getattr(self, "made", []) + list(zip(blocks[0].tokens, blocks[0].made_by))
        return super().commit(blocks, draft, catch_up)


def decode(target, drafter, config, do_sample, prompt, max_new_tokens, head=None):
    """One prompt through the decoder, the assistant drafting over ``head``'s vocabulary."""
    processing = RowProcessors(processors() if do_sample else None)
    assistant = BatchAssistant(drafter, processing, None, frozenset(), 1, prompt.device, head=head)
    decoder = RecordingDecoder(target, assistant, drafter, config, config.routing_mask if config.use_slim else None,
                               processing, StoppingCriteriaList(), prompt.shape[1] + max_new_tokens,
                               RaggedCache(target.config, 1, prompt.device),
                               RandomStream.from_global_seed() if do_sample else None, check_invariants=True)
    rows = decoder.run(prompt.clone(), torch.ones_like(prompt))
    return rows.sequences(None)[0, prompt.shape[1]:].tolist(), decoder


def test_tiered_drafts_come_from_the_vocabulary(prompt_ids):
    target, drafter = tiny_causal_lm("llama"), tiny_causal_lm("llama", seed=3)
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(target, skip=[1, 4]), adaptive=False,
                               tau_accept=0.3, tau_escalate=0.05)
    _, decoder = decode(target, drafter, config, False, prompt_ids, 40, SubsetHead(drafter, EVEN))
    by_tier = {tier: [token for token, made_by in decoder.made if made_by == tier] for tier in ("drafter", "slim")}
    assert by_tier["drafter"] and by_tier["slim"]
    assert all(token in EVEN for token in by_tier["drafter"]), "the slim tier decodes the whole vocabulary"


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_processors_that_allow_nothing_in_the_vocabulary_leave_the_block_to_the_full_model(mode):
    """``suppress_tokens`` rules out every vocabulary token: the assistant stops drafting, so the full model decides
    every token and the output is generate's in both modes; prompt lookup's drafts (lossless) are verified as ever."""
    target = enable_viasd(tiny_causal_lm("llama"))
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[1, 4]), mode=mode, adaptive=False,
                         tau_accept=0.0, tau_escalate=0.0, vocabulary=vocabulary_for(target))
    reference = target.generate(prompt, max_new_tokens=12, do_sample=False, suppress_tokens=EVEN, viasd_config=None)
    drafters = [{"assistant_model": tiny_causal_lm("llama", seed=3)}]
    drafters += [{"prompt_lookup_num_tokens": 3}] if mode == "lossless" else []
    for kwargs in drafters:
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, suppress_tokens=EVEN, viasd_config=config,
                              return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, reference)
        if "assistant_model" in kwargs:
            assert out.viasd_stats.drafted_tokens == 0
        else:
            assert out.viasd_stats.slim_forwards > 0
    torch.manual_seed(0)
    sampled = target.generate(prompt, max_new_tokens=12, do_sample=True, suppress_tokens=EVEN, viasd_config=config,
                              prompt_lookup_num_tokens=3)
    assert all(token not in EVEN for token in sampled[0, prompt.shape[1]:].tolist())

SMALL = 8
SUBSET = [0, 1, 2, 4, 5, 7]


@pytest.fixture(scope="module")
def small_models():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64, vocab_size=SMALL)
    drafter = tiny_causal_lm("llama", seed=7, dtype=torch.float64, vocab_size=SMALL, num_hidden_layers=2)
    return target, drafter, RoutingMask.from_model(target, skip=[2, 3])


@pytest.mark.parametrize("use_slim", [False, True], ids=["two tiers", "three tiers"])
def test_lossless_sampling_over_a_vocabulary_is_exact(small_models, use_slim):
    """The drafter samples its softmax over the vocabulary and hands exactly that proposal on: the output follows the
    target's distribution, and the first draft is kept at the rate Σ min(p_V, q) of that proposal."""
    target, drafter, mask = small_models
    prompt = torch.tensor([[1, 5, 2, 7, 3]])
    config = ViaSDConfig.paper(routing_mask=mask, mode="lossless", adaptive=False, use_slim=use_slim, tau_accept=0.5)
    counts, kept = Counter(), 0
    for seed in range(N):
        torch.manual_seed(seed)
        tokens, decoder = decode(target, drafter, config, True, prompt, 2, SubsetHead(drafter, SUBSET))
        counts[tuple(tokens)] += 1
        assert decoder.stats.drafted_tokens == 1 and tokens[0] in range(SMALL)
        kept += decoder.stats.accepted_at_position[0]
    assert total_variation(counts, exact_two_token_distribution(target, prompt), N) < TV_BOUND
    if not use_slim:
        scores = processors()(prompt, drafter(prompt).logits[:, -1].double().masked_fill(
            ~torch.isin(torch.arange(SMALL), torch.tensor(SUBSET)), float("-inf")))
        p_v = scores.softmax(-1)[0]
        assert abs(kept / N - torch.minimum(p_v, next_probs(target, prompt)).sum().item()) < 5 * 0.5 / N**0.5


def test_the_drafters_proposal_is_its_softmax_over_the_vocabulary(small_models):
    _, drafter, _ = small_models
    prompt = torch.tensor([[1, 5, 2, 7, 3]])
    assistant = BatchAssistant(drafter, RowProcessors(), None, frozenset(), 1, prompt.device,
                               head=SubsetHead(drafter, SUBSET))
    rows = Rows(prompt, torch.ones_like(prompt), StoppingCriteriaList(), max_length=20)
    assistant.read(rows)
    draft = assistant.draft(rows, [3], None, None).rows[0]
    logits = drafter(prompt).logits[0, -1].double()
    expected = torch.full_like(logits, float("-inf"))
    expected[SUBSET] = logits[SUBSET]
    torch.testing.assert_close(draft.probs[0], expected.float().softmax(-1))
    assert draft.tokens[0] == int(expected.argmax()) and all(token in SUBSET for token in draft.tokens)


# --------------------------------------------------------------------------- validation and storage


def test_vocabulary_validation_names_the_problem(tmp_path):
    llama, qwen = tiny_causal_lm("llama"), tiny_causal_lm("qwen2")
    vocabulary = vocabulary_for(llama, tokenizer_size=VOCAB)
    vocabulary.validate_for(llama)
    with pytest.raises(DraftVocabularyError, match="config fingerprint .* pass ViaSDConfig\\(vocabulary=None\\)"):
        vocabulary.validate_for(qwen)
    with pytest.raises(DraftVocabularyError, match="LM head of 96 rows"):
        vocabulary.validate_rows(tiny_causal_lm("llama", vocab_size=64))

    class Tokenizer:
        def __len__(self):
            return 90

    with pytest.raises(DraftVocabularyError, match="tokenizer of 96 tokens, but the tokenizer has 90"):
        vocabulary.validate_for(llama, Tokenizer())
    good = json.loads(vocabulary.to_json())
    for change, message in [({"token_ids": [1, 1]}, "duplicates"), ({"token_ids": [96]}, "outside 0..95"),
                            ({"token_ids": []}, "at least one"), ({"token_ids": ["a"]}, "token_ids"),
                            ({"vocab_size": "96"}, "vocab_size"), ({"coverage": {"8": "x"}}, "coverage"),
                            ({"colour": 1}, "unknown draft vocabulary fields"), ({"schema_version": 9}, "newer")]:
        with pytest.raises(DraftVocabularyError, match=message):
            DraftVocabulary.from_dict(good | change)
    with pytest.raises(DraftVocabularyError, match="lacks required fields \\['target_id'\\]"):
        DraftVocabulary.from_dict({k: v for k, v in good.items() if k != "target_id"})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "draft_vocabulary.json").write_text("{not json")
    with pytest.raises(DraftVocabularyError, match="not valid JSON"):
        DraftVocabulary.from_pretrained(tmp_path / "bad")
    with pytest.raises(TypeError, match="ViaSDConfig.vocabulary must be"):
        ViaSDConfig(mode="tiered", vocabulary=3)


def test_round_trips_through_a_folder_and_a_viasd_config(tmp_path):
    llama = tiny_causal_lm("llama")
    vocabulary = vocabulary_for(llama, coverage={"48": 0.9}, head_cost={"48": 0.7}, counted="a test")
    path = vocabulary.save_pretrained(tmp_path / vocabulary.pair_folder)
    assert path == tmp_path / "tiny-random-llama" / "model-free" / "draft_vocabulary.json"
    assert DraftVocabulary.from_pretrained(path.parent) == vocabulary
    config = ViaSDConfig(mode="tiered", vocabulary=vocabulary)
    config.save_pretrained(tmp_path / "config")
    assert ViaSDConfig.from_pretrained(tmp_path / "config") == config


def test_auto_finds_the_shipped_vocabulary_of_the_pair_and_misses_quietly(tmp_path, monkeypatch, prompt_ids):
    llama = enable_viasd(tiny_causal_lm("llama"))
    monkeypatch.setattr(mask_repo, "shipped_mask_dir", lambda: tmp_path)
    clear_vocabulary_cache()
    assert resolve_vocabulary("auto", llama, "self") is None
    shipped = vocabulary_for(llama)
    shipped.save_pretrained(tmp_path / shipped.pair_folder)
    assert resolve_vocabulary("auto", llama, "self") is None  # a miss is remembered per model
    clear_vocabulary_cache(llama)
    assert resolve_vocabulary("auto", llama, "some/drafter") == shipped  # the target's model-free folder serves any drafter
    assert resolve_vocabulary(None, llama, "self") is None
    assert resolve_vocabulary(str(tmp_path / shipped.pair_folder), llama, "self") == shipped
    other = tiny_causal_lm("llama", hidden_size=48)
    other.config._name_or_path = "tiny-random-llama"
    clear_vocabulary_cache()
    assert resolve_vocabulary("auto", other, "self") is None  # a vocabulary for another model is not used by "auto"
    with pytest.raises(DraftVocabularyError, match="config fingerprint"):
        resolve_vocabulary(shipped, other, "self")
    clear_vocabulary_cache()


def test_a_vocabulary_round_trips_through_the_hub_beside_the_pairs_mask(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test_hub")
    monkeypatch.setattr(mask_repo, "shipped_mask_dir", lambda: tmp_path / "shipped")
    monkeypatch.setattr(hub_files, "_UNREACHABLE", set())
    llama = tiny_causal_lm("llama")
    vocabulary = vocabulary_for(llama, drafter_id="tiny-random-drafter")
    with serve() as hub:
        vocabulary.push_to_hub("viasd-test/masks", subfolder=vocabulary.pair_folder, endpoint=hub.url)
        loaded, where = DraftVocabulary.find_for_pair("tiny-random-llama", "tiny-random-drafter",
                                                      repo_id="viasd-test/masks", endpoint=hub.url)
        assert loaded == vocabulary and "viasd-test/masks" in where
        by_repo = DraftVocabulary.from_pretrained("viasd-test/masks", subfolder="tiny-random-llama/tiny-random-drafter",
                                                  endpoint=hub.url)
        assert by_repo == vocabulary
        with pytest.raises(DraftVocabularyError, match="(?s)no draft vocabulary for target 'tiny-random-llama'.*viasd vocab"):
            DraftVocabulary.find_for_pair("tiny-random-llama", "self", repo_id="viasd-test/masks", endpoint=hub.url)


# --------------------------------------------------------------------------- choosing V


def test_ranking_coverage_and_the_choice_of_size():
    counts, ties = Counter({5: 3, 9: 3, 2: 1}), Counter({9: 1, 7: 4})
    ranking = rank_tokens(12, first={11}, counts=counts, tie_breaks=ties, tokenizer_size=10)
    assert ranking[:5] == [11, 9, 5, 2, 7] and ranking[-1] == 10  # rows beyond the tokenizer come last
    assert coverage(ranking, [9, 5, 0, 10], [2, 4, 12]) == {2: 0.25, 4: 0.5, 12: 1.0}
    size, scores = choose_size({2: 0.5, 4: 0.9, 8: 1.0}, {2: 0.5, 4: 0.6, 8: 0.9}, block=5)
    assert size == 8 and scores[2] == pytest.approx(16.0)
    assert choose_size({2: 0.99, 4: 1.0}, {2: 0.5, 4: 0.6}, block=5)[0] == 2
    with pytest.raises(ValueError, match="no held-out tokens"):
        coverage(ranking, [], [2])


@pytest.mark.parametrize("drafting", ["assistant", "self", "hybrid"])
def test_a_batch_drafts_over_the_vocabulary_and_stays_lossless(drafting, monkeypatch):
    """Every row's drafts come from the vocabulary, through the sliced head run on each row's newest column; every
    row stays generate's own."""
    from test_batch import left_padded, prompts

    import viasd_hf.engine.batch.drafting as batch_drafting

    target = enable_viasd(tiny_causal_lm("llama"))
    drafted, spread_rows = [], []
    chosen_by = batch_drafting.drafted_token
    monkeypatch.setattr(batch_drafting, "drafted_token", lambda scores, *args: (
        lambda chosen: drafted.append(chosen[0]) or chosen if chosen is not None else None)(chosen_by(scores, *args)))
    spread = SubsetHead.spread
    monkeypatch.setattr(SubsetHead, "spread", lambda self, hidden: spread_rows.append(hidden.shape[0]) or spread(self, hidden))
    config = ViaSDConfig.paper(mode="lossless", use_slim=False, adaptive=False, vocabulary=vocabulary_for(target),
                         self_draft_mask=RoutingMask.from_model(target, skip=[1, 3, 4]))
    kwargs: dict = {"assistant_model": tiny_causal_lm("llama", seed=3)} if drafting != "self" else {}
    if drafting == "hybrid":
        kwargs["prompt_lookup_num_tokens"] = 3
    ids, mask = left_padded(prompts(5, repeat=drafting == "hybrid"))
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                viasd_config=None)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                          viasd_config=config, viasd_check_invariants=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference)
    assert drafted and all(token in EVEN for token in drafted), "every model-drafted token is in the vocabulary"
    assert spread_rows and max(spread_rows) == ids.shape[0], "the sliced head ran once per drafting pass, a row each"
