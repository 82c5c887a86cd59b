"""Drafting with a model of another tokenizer (HF's universal assisted generation): the assistant drafts in its own
tokens, its draft reaches the target as the target's tokens of the same text, and the target verifies it as any
other, so lossless greedy output is token-identical to the target's own ``generate``, one prompt or a left-padded
batch. Without both tokenizers a drafter of another vocabulary is refused, naming the fix.

The tokenizers are built offline over a few sentences: a word-level one for the target, and for the drafters the
same words in another order (a twin of the target whose embedding rows follow them, so most drafts are kept) or
a byte-level BPE trained on the sentences (a random qwen2 drafter, whose drafts are mostly rejected).
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import assert_stats_consistent, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd, viasd_generate
from viasd_hf.bench.methods import OTHER_TOKENIZER_METHODS, MethodSettings, MethodTable
from viasd_hf.drafters.translation import Translation, continuation

SENTENCES = ["the cat sat on the mat", "a dog ran to the park", "the bird sang in the tree",
             "my cat and the dog play", "we read a book at home", "the sun is hot today", "she ate an apple and a pear"]
WORDS = ["<unk>", *sorted({word for sentence in SENTENCES for word in sentence.split()})]
PAD = 0
GREEDY = {"do_sample": False, "pad_token_id": PAD}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models run fastest on one thread."""


def word_level(ids: dict[str, int]) -> PreTrainedTokenizerFast:
    """A tokenizer of whole words, ``ids`` its vocabulary: decoding joins the words with spaces."""
    backend = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the sentences (their letters, and merges up to 120 tokens), its end token
    special."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<|end|>"])  # the sentences' bytes: valid text
    backend.train_from_iterator(SENTENCES * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")


@pytest.fixture(scope="module")
def target():
    model = tiny_causal_lm("llama", seed=0, vocab_size=len(WORDS))
    enable_viasd(model)
    return model, word_level({word: i for i, word in enumerate(WORDS)})


@pytest.fixture(scope="module")
def twin(target):
    """The target, slightly perturbed, reading and writing the same words under other ids (reversed)."""
    model, _ = target
    order = list(reversed(range(len(WORDS))))  # the twin's id of the target's token i is order[i]
    drafter = near_copy(model, scale=1e-4, seed=1)
    with torch.no_grad():
        for weights in (drafter.get_input_embeddings().weight, drafter.get_output_embeddings().weight):
            weights[order] = weights.clone()
    return drafter, word_level({word: order[i] for i, word in enumerate(WORDS)})


@pytest.fixture(scope="module")
def stranger():
    """A random qwen2 of a byte-level BPE vocabulary: another architecture and another tokenizer."""
    tokenizer = byte_level_bpe()
    return tiny_causal_lm("qwen2", seed=3, vocab_size=len(tokenizer)), tokenizer


def encoded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts' tokens, left-padded with ``PAD``, and their attention mask."""
    rows = [tokenizer.encode(text) for text in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
    return ids, torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])


def configs(model) -> dict[str, ViaSDConfig]:
    """The slim tier on every block and drafts of γ tokens (a random drafter is never confident enough to draft
    more than one), or the cost model's choices."""
    mask = RoutingMask.from_model(model, skip=[2])
    return {"slim": ViaSDConfig.paper(mode="lossless", routing_mask=mask, adaptive=False, draft_confidence_threshold=None),
            "adaptive": ViaSDConfig(use_slim=False)}


def generated(sequence: torch.Tensor, width: int, eos: int) -> int:
    """How many tokens a row of ``generate``'s output generated after its prompt (of ``width`` with the padding)."""
    new = sequence[width:].tolist()
    return new.index(eos) + 1 if eos in new else len(new)


@pytest.mark.parametrize("texts", [["the cat sat on"], ["a dog ran", "the bird sang in the tree and"]],
                         ids=["one", "padded-two"])
@pytest.mark.parametrize("config", ["slim", "adaptive"])
@pytest.mark.parametrize("drafter", ["twin", "stranger"])
def test_lossless_greedy_equals_generate(target, twin, stranger, texts, config, drafter):
    model, tokenizer = target
    assistant, assistant_tokenizer = twin if drafter == "twin" else stranger
    ids, mask = encoded(tokenizer, texts)
    out = model.generate(ids, attention_mask=mask, assistant_model=assistant, tokenizer=tokenizer,
                         assistant_tokenizer=assistant_tokenizer, viasd_config=configs(model)[config],
                         max_new_tokens=16, return_dict_in_generate=True, viasd_check_invariants=True, **GREEDY)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=16, viasd_config=None, **GREEDY)
    assert torch.equal(out.sequences, reference)
    stats = out.viasd_stats
    assert stats.batch_size == len(texts), "a drafter of another tokenizer decodes in the batched engine"
    for row, sequence in zip(stats.rows, reference):
        new_tokens = generated(sequence, ids.shape[1], model.generation_config.eos_token_id)
        assert_stats_consistent(row, new_tokens, "lossless", stopped_inside_block=True)
    assert stats.drafted_tokens > 0
    if drafter == "twin":
        assert stats.accepted_tokens >= 0.8 * stats.drafted_tokens, "the twin's drafts, translated, are the target's"


def test_sampling_keeps_translated_drafts_exactly(target, twin):
    """Translated drafts are point proposals: sampling with top_k=1 (every distribution one-hot) is greedy decoding."""
    model, tokenizer = target
    assistant, assistant_tokenizer = twin
    ids, mask = encoded(tokenizer, ["the cat sat on", "a dog"])
    out = model.generate(ids, attention_mask=mask, assistant_model=assistant, tokenizer=tokenizer,
                         assistant_tokenizer=assistant_tokenizer, viasd_config=ViaSDConfig(use_slim=False),
                         max_new_tokens=12, do_sample=True, top_k=1, pad_token_id=PAD, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=12, viasd_config=None,
                                                     **GREEDY))
    assert out.viasd_stats.accepted_tokens > 0


def test_prompt_lookup_beside_a_translated_drafter(target, stranger):
    model, tokenizer = target
    assistant, assistant_tokenizer = stranger
    ids, mask = encoded(tokenizer, ["the cat sat on the mat the cat sat on the", "a dog ran to the park a dog"])
    out = model.generate(ids, attention_mask=mask, assistant_model=assistant, tokenizer=tokenizer,
                         assistant_tokenizer=assistant_tokenizer, prompt_lookup_num_tokens=3,
                         viasd_config=ViaSDConfig(use_slim=False), max_new_tokens=16, **GREEDY)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=16, viasd_config=None, **GREEDY))


def test_custom_generate_takes_the_tokenizers_under_its_own_names(target, twin):
    """``generate`` hands a ``custom_generate`` callable no ``tokenizer``/``assistant_tokenizer``: ours are named."""
    model, tokenizer = target
    assistant, assistant_tokenizer = twin
    ids, _ = encoded(tokenizer, ["the sun is"])
    out = type(model).generate(model, ids, custom_generate=viasd_generate, drafter=assistant, viasd_tokenizer=tokenizer,
                               drafter_tokenizer=assistant_tokenizer, viasd_config=configs(model)["slim"],
                               max_new_tokens=10, return_dict_in_generate=True, **GREEDY)
    assert out.viasd_stats.drafted_tokens > 0
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=10, viasd_config=None, **GREEDY))


def test_the_drafter_reads_a_row_once_then_what_it_committed_since(target, twin):
    """The drafter's cache holds the common prefix of what it fed and each row's context: after the prompts, each
    block's passes feed the tokens committed since the last block and the drafts, a few tokens, not the text."""
    model, tokenizer = target
    assistant, assistant_tokenizer = twin
    widths = []
    hook = assistant.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        (args[0] if args else kwargs["input_ids"]).shape[1]), with_kwargs=True)
    ids, mask = encoded(tokenizer, ["we read a book at home and the sun is hot", "a dog"])
    try:
        model.generate(ids, attention_mask=mask, assistant_model=assistant, tokenizer=tokenizer,
                       assistant_tokenizer=assistant_tokenizer, viasd_config=configs(model)["slim"], max_new_tokens=16,
                       **GREEDY)
    finally:
        hook.remove()
    assert widths[0] == ids.shape[1], "one pass reads the prompts and the first tokens, but each row's newest"
    assert max(widths[1:]) <= ViaSDConfig().knobs.num_draft_tokens + 1


def test_a_drafter_of_another_vocabulary_without_tokenizers_is_refused_with_the_fix(target, stranger):
    model, tokenizer = target
    assistant, assistant_tokenizer = stranger
    ids, _ = encoded(tokenizer, ["the cat"])
    for only in ({}, {"tokenizer": tokenizer}, {"assistant_tokenizer": assistant_tokenizer}):
        with pytest.raises(ValueError, match=r"differs from the target's.*tokenizer=.*assistant_tokenizer="):
            model.generate(ids, assistant_model=assistant, viasd_config=ViaSDConfig(), max_new_tokens=4, **GREEDY,
                           **only)


def test_a_draft_is_the_target_tokens_of_the_drafted_text_after_the_committed_one():
    words, bpe = word_level({word: i for i, word in enumerate(WORDS)}), byte_level_bpe()
    translation = Translation(words, bpe)
    committed = words.encode("the cat")
    context = translation.context(committed)
    assert bpe.decode(context) == "the cat"
    assert translation.draft(committed, context, bpe.encode(" sat on the mat")) == words.encode("sat on the mat")
    assert continuation(bpe, bpe.encode("the cat"), " sat on") == bpe.encode(" sat on")
    ca = bpe.encode("the ca")
    assert bpe.encode("the cat")[: len(ca)] != ca, "the seam splits a token of the whole text"
    assert continuation(bpe, ca, "t sat") == [], "no draft begins inside a token the target would write whole"


def test_the_bench_compares_hf_and_viasd_drafting_with_another_tokenizer(target, stranger):
    model, tokenizer = target
    assistant, assistant_tokenizer = stranger
    other_drafter = (assistant, tokenizer, assistant_tokenizer)
    table = MethodTable(model, assistant, RoutingMask.from_model(model, skip=[2]), None,
                        MethodSettings(draft_confidence_threshold=None), other_drafter=other_drafter)
    methods = table.build(["greedy", *OTHER_TOKENIZER_METHODS])
    ids, _ = encoded(tokenizer, ["the cat sat on the mat and"])
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": PAD}
    outcomes = {name: method(ids, common) for name, method in methods.items()}
    for name in OTHER_TOKENIZER_METHODS:
        assert outcomes[name].tokens == outcomes["greedy"].tokens, name
        assert outcomes[name].drafted > 0, f"{name} drafted through text"
    with pytest.raises(ValueError, match="--other-drafter"):
        MethodTable(model, assistant, table.mask, None).build(["greedy", "viasd_other_tokenizer"])
