"""Batched lossless greedy VIA-SD: every row is token-identical to that prompt's own greedy ``generate`` and to
``generate``'s batched greedy decoding of the same padded batch; rows keep their own number of drafts per block,
stop on their own and leave the batch; and what a batch does not support is refused with the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from conftest import (
    NEAR_TIE_REPORT,
    VOCAB,
    RecordingStreamer,
    assert_stats_consistent,
    first_near_tie,
    left_padded,
    near_copy,
    random_prompts,
    tiny_causal_lm,
    tiny_model_of,
    zoo,
)
from viasd_hf import RoutingMask, ViaSDConfig, ViaSDStats, enable_viasd
from viasd_hf.control.speculation_switch import SpeculationSwitch
from viasd_hf.engine.batch import BatchViaSDStats, ragged_cache
from viasd_hf.engine.batch.model_drafts import Reader
from viasd_hf.engine.batch.ragged_cache import RaggedCache

PAD = 0
GREEDY = {"do_sample": False, "pad_token_id": PAD}


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models run fastest on one thread


def prompts(seed: int, lengths=(11, 6, 9), repeat: bool = False) -> list[torch.Tensor]:
    return random_prompts(seed, lengths, repeat)


def slim_config(target, **overrides) -> ViaSDConfig:
    """VIA-SD with its slim tier on every block (it repairs drafts before the full model verifies)."""
    return ViaSDConfig.paper(**{"mode": "lossless", "routing_mask": RoutingMask.from_model(target, skip=[2]),
                                "adaptive": False} | overrides)


def batched(target, rows, config, assistant=None, max_new_tokens=24, **kwargs):
    ids, mask = left_padded(rows)
    return target.generate(ids, attention_mask=mask, assistant_model=assistant, viasd_config=config,
                           max_new_tokens=max_new_tokens, viasd_check_invariants=True, return_dict_in_generate=True,
                           **GREEDY | kwargs)


def assert_identical_to_generate(target, rows, out, max_new_tokens=24, **kwargs) -> list[int]:
    """Each row is its prompt's own greedy ``generate`` (then padding), and the batch is ``generate``'s batched one;
    returns the tokens each row generated."""
    ids, mask = left_padded(rows)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, viasd_config=None,
                                **GREEDY | kwargs)
    assert torch.equal(out.sequences, reference)
    generated = []
    for i, row in enumerate(rows):
        alone = target.generate(row[None], max_new_tokens=max_new_tokens, viasd_config=None, **GREEDY | kwargs)[0]
        mine = out.sequences[i, ids.shape[1] - len(row) :]
        assert torch.equal(mine[: len(alone)], alone), f"row {i}"
        assert bool((mine[len(alone) :] == PAD).all()), f"row {i} is padded after it stopped"
        generated.append(len(alone) - len(row))
    return generated


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("drafter_kind", ["assistant", "prompt_lookup", "hybrid", "self"])
def test_every_row_equals_its_own_greedy_generate_and_the_batched_one(near_pair, seed, drafter_kind):
    target, assistant = near_pair
    rows = prompts(seed, repeat=drafter_kind in ("prompt_lookup", "hybrid"))
    lookup = {"prompt_lookup_num_tokens": 4} if drafter_kind in ("prompt_lookup", "hybrid") else {}
    config = slim_config(target, self_draft_mask=RoutingMask.from_model(target, skip=[1, 2]))
    out = batched(target, rows, config, assistant if drafter_kind in ("assistant", "hybrid") else None, **lookup)
    generated = assert_identical_to_generate(target, rows, out)
    stats = out.viasd_stats
    assert isinstance(stats, BatchViaSDStats) and stats.batch_size == len(rows) == len(stats.rows)
    assert stats.drafted_tokens > 0 and stats.slim_forwards > 0, "the drafter and the slim tier ran"
    for row, new_tokens in zip(stats.rows, generated):
        assert_stats_consistent(row, new_tokens, "lossless", stopped_inside_block=True)
    assert stats.new_tokens == sum(generated) and stats.decode_full_forwards == stats.blocks


@pytest.mark.parametrize("config", ["default", "no_slim_tier"])
def test_adaptive_configs_are_lossless_too(near_pair, config, speculating):
    target, assistant = near_pair
    rows = prompts(7, lengths=(5, 12, 8, 10))
    chosen = {"default": ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2])),
              "no_slim_tier": ViaSDConfig(use_slim=False)}
    out = batched(target, rows, chosen[config], assistant, max_new_tokens=20)
    assert_identical_to_generate(target, rows, out, max_new_tokens=20)


def test_plain_blocks_between_speculative_ones_change_no_token(near_pair, monkeypatch):
    """Where speculation does not pay, blocks decode one token per row; the drafter, which then has not read the
    prompts (the first block is plain here), reads what it lacks when speculation resumes."""
    target, assistant = near_pair
    monkeypatch.setattr(SpeculationSwitch, "speculates", lambda switch: switch.block % 3 != 0)
    rows = prompts(9, lengths=(6, 11, 3))
    out = batched(target, rows, ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2])), assistant)
    assert_identical_to_generate(target, rows, out)
    stats = out.viasd_stats
    assert 0 < stats.plain_blocks < stats.blocks and stats.drafted_tokens > 0 and stats.prefill_forwards == 0
    assert max(row["plain_blocks"] for row in stats.to_dict()["rows"]) == stats.plain_blocks  # the row decoding longest


def test_a_batch_decoding_plainly_takes_one_full_pass_per_token_as_generate(near_pair, monkeypatch):
    """The pass over the prompts gives every row its first token (the first block), as ``generate``'s first step:
    n new tokens a row cost n batched passes, not a prefill and n more."""
    target, assistant = near_pair
    monkeypatch.setattr(SpeculationSwitch, "speculates", lambda switch: False)
    rows = prompts(4, lengths=(6, 11, 3))
    out = batched(target, rows, ViaSDConfig(use_slim=False), assistant, max_new_tokens=6)
    assert_identical_to_generate(target, rows, out, max_new_tokens=6)
    stats = out.viasd_stats
    assert stats.full_forwards == stats.blocks == stats.plain_blocks == 6 and stats.prefill_forwards == 0
    assert stats.drafter_forwards == 0 and all(row.full_forwards == 6 for row in stats.rows)


@pytest.fixture
def reader_passes(near_pair, monkeypatch):
    """The pair's assistant drafts with a reader (a copy of it, measured faster from 12 tokens a pass): the shapes of
    the passes each of them runs, recorded while the test lasts."""
    import viasd_hf.generation as generation

    _, assistant = near_pair
    reader = Reader(copy.deepcopy(assistant), from_tokens=12)
    passes = {"reader": [], "assistant": []}
    handles = [model.register_forward_pre_hook(
        lambda _, args, kwargs, name=name: passes[name].append((args[0] if args else kwargs["input_ids"]).shape),
        with_kwargs=True) for name, model in (("reader", reader.twin), ("assistant", assistant))]
    monkeypatch.setattr(generation, "drafting_reader", lambda model: reader if model is assistant else None)
    yield passes
    for handle in handles:
        handle.remove()


def test_the_assistant_runs_long_passes_through_its_reader_and_short_ones_itself(near_pair, reader_passes,
                                                                                 speculating):
    """Where the drafting model has a reader (a 4-bit copy's dequantised twin, measured faster from some number of
    tokens a pass), the prompts' read (all rows, one pass) and every pass at least that long go through it, every
    shorter pass through the model; the output is greedy's."""
    target, assistant = near_pair
    rows = prompts(5, lengths=(12, 20, 16))
    out = batched(target, rows, ViaSDConfig(use_slim=False), assistant)
    assert_identical_to_generate(target, rows, out)
    assert reader_passes["reader"][0] == torch.Size([3, 20]), "one read of every prompt, padded to the longest"
    assert all(shape.numel() >= 12 for shape in reader_passes["reader"])
    assert reader_passes["assistant"] and all(shape.numel() < 12 for shape in reader_passes["assistant"])
    assert len(reader_passes["reader"]) + len(reader_passes["assistant"]) == out.viasd_stats.drafter_forwards


def test_prompts_of_very_different_lengths_are_read_one_row_a_pass(near_pair, reader_passes, speculating):
    """Where one pass over every prompt would mostly compute padding, the drafter reads each prompt in a pass of its
    own, through its reader where the prompt is long enough; the rows then draft in one cache, and the output is
    greedy's."""
    target, assistant = near_pair
    rows = prompts(6, lengths=(150, 4, 9))
    out = batched(target, rows, ViaSDConfig(use_slim=False), assistant)
    assert_identical_to_generate(target, rows, out)
    assert reader_passes["reader"][0] == torch.Size([1, 150]), "the long prompt alone, through the reader"
    assert reader_passes["assistant"][:2] == [torch.Size([1, 4]), torch.Size([1, 9])], "each short prompt alone"
    assert reader_passes["assistant"][2][0] == 3, "then the rows draft in one pass"
    assert len(reader_passes["reader"]) + len(reader_passes["assistant"]) == out.viasd_stats.drafter_forwards


def test_rows_stop_at_their_own_eos_and_leave_the_batch(near_pair):
    target, assistant = near_pair
    rows = prompts(11, lengths=(9, 6, 12))
    ids, mask = left_padded(rows)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=24, viasd_config=None, eos_token_id=None,
                           **GREEDY)[:, ids.shape[1] :]
    ends = [int(free[0, 3]), int(free[1, 12])]  # row 0 ends by the 4th token; row 1 by the 13th unless row 0's comes first
    out = batched(target, rows, slim_config(target), assistant, eos_token_id=ends)
    assert_identical_to_generate(target, rows, out, eos_token_id=ends)
    stats = out.viasd_stats
    new = [row.new_tokens for row in stats.rows]
    assert new[0] <= 4 and len(set(new)) > 1, "rows finished at different times"
    left = {entry["row"]: entry for entry in stats.rows_left}
    assert sorted(left) == [0, 1, 2] and left[0]["block"] < max(entry["block"] for entry in left.values())
    assert [left[i]["new_tokens"] for i in range(3)] == new


class ScoresSeen(StoppingCriteria):
    """Records, for every row it is asked about, how many new tokens the row has and how many scores it was given."""

    def __init__(self, prompt_width: int):
        self.prompt_width, self.seen = prompt_width, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append((input_ids.shape[1] - self.prompt_width, len(scores), scores[-1].shape))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("mode", ["lossless", "tiered"])
def test_scores_and_logits_of_each_row_are_generates_step_by_step(near_pair, mode):
    """``output_scores`` / ``output_logits`` of a batch: step ``t`` holds every row's scores for its ``t``-th new token
    (fp32 tiny models: equal to ``generate``'s batched greedy up to float32 rounding of passes of other shapes); a row
    that finished puts all mass on the padding; stopping criteria get each row's own scores."""
    target, assistant = near_pair
    rows = prompts(11, lengths=(9, 6, 12))
    ids, mask = left_padded(rows)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, viasd_config=None, eos_token_id=None,
                           **GREEDY)[:, ids.shape[1] :]
    ends = [int(free[0, 3])]  # row 0 ends by its 4th token
    seen = ScoresSeen(ids.shape[1])
    config = slim_config(target, mode=mode) if mode == "tiered" else slim_config(target)
    wanted = {"output_scores": True, "output_logits": True, "eos_token_id": ends, "max_new_tokens": 20}
    out = batched(target, rows, config, assistant, stopping_criteria=StoppingCriteriaList([seen]), **wanted)
    reference = target.generate(ids, attention_mask=mask, viasd_config=None, return_dict_in_generate=True,
                                **GREEDY | wanted)
    stats = out.viasd_stats
    new = [row.new_tokens for row in stats.rows]
    assert new[0] <= 4 and len(set(new)) > 1 and stats.drafted_tokens > 0, "rows speculated and finished apart"
    if mode == "tiered":
        assert stats.committed_by["slim"] > 0, "some scores are the slim tier's"
    for name in ("scores", "logits"):
        ours, theirs = getattr(out, name), getattr(reference, name)
        assert len(ours) == max(new) and (mode == "tiered" or len(theirs) == len(ours))
        for step, (mine, generates) in enumerate(zip(ours, theirs)):
            assert mine.shape == generates.shape == (len(rows), VOCAB)
            for i, row_new in enumerate(new):
                if step >= row_new:
                    assert mine[i, PAD] == 0 and bool((mine[i, 1:] == -float("inf")).all()), "padding after the end"
                    continue
                if mode == "lossless" or stats.rows[i].slim_committed_tokens == 0:  # the full model's own scores
                    assert int(mine[i].argmax()) == int(out.sequences[i, ids.shape[1] + step]), "they chose it"
                    torch.testing.assert_close(mine[i], generates[i], rtol=1e-4, atol=1e-4)
    assert all(given == tokens and shape == (1, VOCAB) for tokens, given, shape in seen.seen)
    assert set(range(1, max(new))) <= {tokens for tokens, _, _ in seen.seen}  # the last one: max length decides


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_new_tokens(near_pair, max_new_tokens):
    target, assistant = near_pair
    rows = prompts(5)
    out = batched(target, rows, slim_config(target), assistant, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == max(len(row) for row in rows) + max_new_tokens
    assert_identical_to_generate(target, rows, out, max_new_tokens=max_new_tokens)


def test_a_plain_tensor_without_return_dict_and_prompts_of_one_length(near_pair):
    target, assistant = near_pair
    ids = torch.stack(prompts(2, lengths=(8, 8, 8)))
    out = target.generate(ids, assistant_model=assistant, viasd_config=slim_config(target), max_new_tokens=16, **GREEDY)
    assert torch.equal(out, target.generate(ids, max_new_tokens=16, viasd_config=None, **GREEDY))


def test_what_only_batching_makes_true(near_pair):
    """One block's rows keep different numbers of drafts, rows leave at different blocks, and the target runs fewer
    passes than there are tokens, each over every row still decoding."""
    target, assistant = near_pair
    rows = prompts(13, lengths=(10, 7, 12, 5))
    ids, mask = left_padded(rows)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=30, viasd_config=None, eos_token_id=None,
                           **GREEDY)[:, ids.shape[1] :]
    widths = []  # the rows each target pass ran over

    def record(module, args, kwargs):
        widths.append((args[0] if args else kwargs["input_ids"]).shape[0])

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = batched(target, rows, ViaSDConfig.paper(mode="lossless", use_slim=False, adaptive=False, draft_confidence_threshold=None),
                      assistant, max_new_tokens=30, eos_token_id=int(free[1, 5]))
    finally:
        handle.remove()
    stats = out.viasd_stats
    assert stats.ragged_blocks > 0
    assert len({entry["block"] for entry in stats.rows_left}) > 1
    assert len(widths) == stats.full_forwards < stats.new_tokens
    assert widths[0] == len(rows) and min(widths) < len(rows), "every pass ran over the rows still decoding"
    assert stats.decode_full_forwards == stats.blocks


def test_compacting_the_caches_after_every_block_changes_no_token(near_pair, monkeypatch):
    target, assistant = near_pair
    monkeypatch.setattr(ragged_cache, "COMPACT_AT_LEAST", 0)
    monkeypatch.setattr(ragged_cache, "COMPACT_SHARE", 0.0)
    rows = prompts(17, lengths=(4, 13, 9))
    out = batched(target, rows, slim_config(target), assistant, max_new_tokens=20)
    assert_identical_to_generate(target, rows, out, max_new_tokens=20)
    compactions = out.viasd_stats.compactions
    assert compactions["target"] >= out.viasd_stats.blocks - 1 and compactions["drafter"] > 0


def test_a_single_prompt_is_a_batch_of_one(near_pair):
    target, assistant = near_pair
    ids = prompts(1)[0][None]
    out = target.generate(ids, assistant_model=assistant, viasd_config=slim_config(target),
                          max_new_tokens=12, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12, **GREEDY))
    stats = out.viasd_stats
    assert isinstance(stats, ViaSDStats) and stats.batch_size == 1 and len(stats.rows) == 1
    assert stats.rows[0].new_tokens == stats.new_tokens == 12


def test_the_ragged_cache_forgets_compacts_and_selects():
    target = tiny_causal_lm("llama")
    cache = RaggedCache(target.config, 2, torch.device("cpu"))
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    cache.run(target, ids, real, keep=1)
    cache.forget_last(torch.tensor([2, 0]))  # row 0 keeps 2 of its 4 tokens: its last two columns become holes
    assert cache.mask.tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    nxt = torch.tensor([[5], [7]])
    before = cache.run(target, nxt, torch.ones((2, 1), dtype=torch.bool), keep=1)
    cache.forget_last(torch.tensor([1, 1]))
    cache.compact()
    assert cache.mask.tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]] and cache.columns == 6
    after = cache.run(target, nxt, torch.ones((2, 1), dtype=torch.bool), keep=1)
    torch.testing.assert_close(after, before)  # the same tokens at the same positions: the same logits
    cache.select(torch.tensor([0]))
    assert cache.mask.tolist() == [[0, 0, 0, 0, 1, 1, 1]] and cache.cache.layers[0].keys.shape[0] == 1


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gemma3_text", "gpt2", "falcon"])
def test_a_drafting_pass_gives_each_rows_newest_logits_and_runs_the_head_on_one_column(kind):
    """Rows feeding different numbers of tokens (a read of prompts, then a block's first pass) get the logits after
    their own newest token, as the model computes them over the row alone (sliding windows included), and the LM
    head runs once per row, not once per column fed."""
    model = tiny_model_of(kind, layers=2)
    sequences = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 3, 7)]
    heads = []  # (rows, columns) of each pass of the LM head
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: heads.append(tuple(args[0].shape[:2])))
    cache = RaggedCache(model.config, 3, torch.device("cpu"))
    for fed in ((7, 2, 5), (2, 1, 0)):  # the tokens each row feeds in the pass, after what it fed before
        start = [len(cache.mask[r].nonzero()) for r in range(3)]
        feeds = [sequence[s : s + n] for sequence, s, n in zip(sequences, start, fed)]
        assert not cache.reads_apart(list(fed))
        logits = cache.newest(model, *ragged_cache.right_padded(feeds, torch.device("cpu")))
        for row, (sequence, s, n) in enumerate(zip(sequences, start, fed)):
            if n:
                alone = model(torch.tensor([sequence[: s + n]])).logits[0, -1]
                torch.testing.assert_close(logits[row], alone, rtol=1e-4, atol=1e-4)
    assert [columns for rows, columns in heads if rows == 3] == [1, 1]  # the batched passes, beside the rows' own


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gemma3_text", "gpt2", "falcon"])
def test_rows_read_one_a_pass_draft_on_in_one_cache_as_each_row_alone(kind):
    """Prompts of very different lengths, read into an empty cache one row a pass and laid out left-padded: each row's
    logits after its read and after later passes are the model's over that row alone (sliding windows included)."""
    model = tiny_model_of(kind, layers=2)
    sequences = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (160, 3, 9)]
    cache = RaggedCache(model.config, 3, torch.device("cpu"))
    assert cache.reads_apart([157, 1, 6])
    feeds = [sequence[:n] for sequence, n in zip(sequences, (157, 1, 6))]
    logits = [cache.newest_apart([model] * 3, feeds)]
    assert cache.mask.sum(-1).tolist() == [157, 1, 6] and not cache.reads_apart([1, 1, 1])
    for fed, start in (((2, 1, 3), (157, 1, 6)), ((1, 1, 0), (159, 2, 9))):
        feeds = [sequence[s : s + n] for sequence, s, n in zip(sequences, start, fed)]
        logits.append(cache.newest(model, *ragged_cache.right_padded(feeds, torch.device("cpu"))))
    for after, (fed, start) in zip(logits, (((157, 1, 6), (0, 0, 0)), ((2, 1, 3), (157, 1, 6)),
                                             ((1, 1, 0), (159, 2, 9)))):
        for row, (sequence, s, n) in enumerate(zip(sequences, start, fed)):
            if n:
                alone = model(torch.tensor([sequence[: s + n]])).logits[0, -1]
                torch.testing.assert_close(after[row], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gemma3_text", "gpt2", "falcon"])
def test_a_targets_first_pass_reads_prompts_of_very_different_lengths_one_row_a_pass(kind):
    """The target's first pass over left-padded prompts of very different lengths, each row's draft after its prompt
    (right-padded), computes each row alone, not padded to the longest: the logits of every real column among the
    last ``keep`` are the model's over that row alone, where a padded pass puts them, and later passes see each row's
    tokens and nothing else (sliding windows included). Prompts of alike lengths are read in one pass."""
    model = tiny_model_of(kind, layers=2)
    sequences = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (200, 9, 5)]
    prompt_lengths, draft_lengths = (200, 6, 2), (0, 3, 3)
    rows = [(sequence[:n], sequence[n : n + d]) for sequence, n, d in zip(sequences, prompt_lengths, draft_lengths)]
    cache = RaggedCache(model.config, 3, torch.device("cpu"))
    ids, mask = left_padded([torch.tensor(prompt) for prompt, _ in rows])
    drafted, drafted_real = ragged_cache.right_padded([draft for _, draft in rows], torch.device("cpu"))
    tokens, real = torch.cat([ids, drafted], dim=-1), torch.cat([mask.bool(), drafted_real], dim=-1)
    logits, columns = cache.read(model, tokens, real, keep=4)
    assert columns == 200 + 9 + 5 < real.numel() and cache.mask.sum(-1).tolist() == [200, 9, 5]
    for row, (prompt, draft) in enumerate(rows):
        alone = model(torch.tensor([prompt + draft])).logits[0, -len(draft) - 1 :]
        torch.testing.assert_close(logits[row, : len(draft) + 1], alone, rtol=1e-4, atol=1e-4)
    fed = [[7], [8, 9], [10]]
    later = cache.newest(model, *ragged_cache.right_padded(fed, torch.device("cpu")))
    for row, ((prompt, draft), more) in enumerate(zip(rows, fed)):
        alone = model(torch.tensor([prompt + draft + more])).logits[0, -1]
        torch.testing.assert_close(later[row], alone, rtol=1e-4, atol=1e-4)
    alike = RaggedCache(model.config, 3, torch.device("cpu"))
    ids, mask = left_padded([torch.tensor(sequence[:n]) for sequence, n in zip(sequences, (9, 8, 5))])
    assert alike.read(model, ids, mask.bool(), keep=1)[1] == ids.numel()


@pytest.mark.parametrize("drafter_kind", ["assistant", "self", "plain"])
def test_prompts_of_very_different_lengths_decode_as_generate_decodes_them(near_pair, drafter_kind, monkeypatch,
                                                                          request):
    """A batch mixing a long prompt with short ones, which the target reads one row a pass (``RaggedCache.read``): in
    the first block carrying the drafts, before a self-drafter's first draft, or plainly. Every row is ``generate``'s."""
    target, assistant = near_pair
    if drafter_kind == "plain":
        monkeypatch.setattr(SpeculationSwitch, "speculates", lambda switch: switch.block % 2 == 1)
    else:
        request.getfixturevalue("speculating")
    read, reads = RaggedCache.read, []

    def recorded(cache, model, tokens, real, keep):
        logits, columns = read(cache, model, tokens, real, keep)
        reads.append((columns, real.numel()))
        return logits, columns

    monkeypatch.setattr(RaggedCache, "read", recorded)
    rows = prompts(5, lengths=(300, 6, 9))
    config = (slim_config(target, self_draft_mask=RoutingMask.from_model(target, skip=[1, 2])) if drafter_kind == "self"
              else ViaSDConfig(use_slim=False))
    out = batched(target, rows, config, assistant if drafter_kind == "assistant" else None)
    assert_identical_to_generate(target, rows, out)
    assert len(reads) == 1 and reads[0][0] < reads[0][1], "the target read each prompt alone"
    assert (out.viasd_stats.prefill_forwards == 1) == (drafter_kind == "self")


def word_tokenizer():
    """A tokenizer over the tiny models' vocabulary, built offline: token ``i`` is the word ``w{i}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w1")


def test_a_pipeline_with_a_batch_size_decodes_each_batch_with_viasd():
    from transformers import pipeline

    model = tiny_causal_lm("qwen2", seed=3)
    assistant = near_copy(model, seed=4)
    texts = [" ".join(f"w{i}" for i in row.tolist()) for row in prompts(21, lengths=(7, 12, 4, 9))]
    plain = pipeline("text-generation", model=model, tokenizer=word_tokenizer())
    expected = [plain(text, max_new_tokens=12, do_sample=False) for text in texts]
    enable_viasd(model, slim_config(model))
    rows_per_pass = {model: [], assistant: []}
    for module, widths in rows_per_pass.items():
        module.register_forward_pre_hook(lambda module, args, kwargs, widths=widths: widths.append(
            (args[0] if args else kwargs["input_ids"]).shape[0]), with_kwargs=True)
    generator = pipeline("text-generation", model=model, tokenizer=word_tokenizer(), assistant_model=assistant)
    assert generator(texts, batch_size=2, max_new_tokens=12, do_sample=False) == expected
    assert max(rows_per_pass[model]) == max(rows_per_pass[assistant]) == 2, "VIA-SD drafted and verified two at once"


# -- tiered mode -----------------------------------------------------------------------------------------------------


def test_tiered_rows_commit_on_the_slim_tiers_authority_and_the_full_model_catches_up(near_pair):
    """A routing mask that skips no layer makes the slim verifier the full model, so every token it commits on its own
    authority is the full model's greedy choice: each tiered row is its prompt's greedy ``generate`` while the slim
    tier commits tokens the target's cache takes only at the full model's next pass (a catch-up, at most
    ``max_slim_backlog`` tokens later, or an escalation)."""
    target, assistant = near_pair
    rows = prompts(4, lengths=(7, 12, 9))
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(target, skip=[]), tau_accept=1.0, max_slim_backlog=6,
                         adaptive=False)
    out = batched(target, rows, config, assistant)
    generated = assert_identical_to_generate(target, rows, out)
    stats = out.viasd_stats
    assert stats.committed_by["slim"] > 0 and stats.slim_accepted_tokens > 0, "the slim tier committed drafts and tokens"
    assert 0 < stats.full_forwards < stats.blocks, "blocks the slim tier decided took no full pass"
    assert sum(row.catch_up_blocks for row in stats.rows) > 0
    assert max(row.peak_slim_backlog for row in stats.rows) <= 6
    for row, new_tokens in zip(stats.rows, generated):
        assert_stats_consistent(row, new_tokens, "tiered", stopped_inside_block=True)


def test_tiered_rows_escalating_every_draft_are_lossless(near_pair):
    """τ_acc = τ_esc = 1: the slim tier escalates every draft, so the full model decides every block."""
    target, assistant = near_pair
    rows = prompts(6, lengths=(9, 5, 11))
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(target, skip=[2]), tau_accept=1.0,
                         tau_escalate=1.0, adaptive=False)
    out = batched(target, rows, config, assistant)
    generated = assert_identical_to_generate(target, rows, out)
    for row, new_tokens in zip(out.viasd_stats.rows, generated):
        assert_stats_consistent(row, new_tokens, "tiered", stopped_inside_block=True)
        assert row.slim_committed_tokens == 0 and row.slim_forwards == row.escalated_blocks > 0


def test_tiered_sampling_of_a_batch_is_reproducible_and_the_slim_tier_commits(near_pair):
    target, assistant = near_pair
    rows = prompts(8, lengths=(7, 10))
    config = ViaSDConfig.paper(mode="tiered", routing_mask=RoutingMask.from_model(target, skip=[2]), adaptive=False,
                         self_draft_mask=RoutingMask.from_model(target, skip=[1, 2]))
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(batched(target, rows, config, None, do_sample=True, temperature=0.9))
    assert torch.equal(runs[0].sequences, runs[1].sequences), "one seed, one output"
    stats = runs[0].viasd_stats
    assert stats.committed_by["slim"] > 0 and stats.drafted_tokens > 0


# -- what a batch does not do, refused with the fix -----------------------------------------------------------------


class AtFourteenTokens(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 14, dtype=torch.bool)


@pytest.mark.parametrize("request_, match", [
    ({"streamer": RecordingStreamer()}, "RecordingStreamer only supports batch size 1"),
    ({"do_sample": True, "num_return_sequences": 2, "eos_token_id": None,
      "stopping_criteria": StoppingCriteriaList([AtFourteenTokens()])}, "3 prompts x num_return_sequences=2"),
    ({"right_padded": True}, "left-padded.*padding_side='left'"),
    ({"all_padding": True}, "a prompt of the batch is all padding"),
    ({"eos_token_id": None, "stopping_criteria": StoppingCriteriaList([AtFourteenTokens()])}, "set eos_token_id"),
])
def test_unsupported_requests_are_refused_with_the_fix(near_pair, request_, match):
    target, assistant = near_pair
    request_ = dict(request_)
    rows = prompts(0)
    ids, mask = left_padded(rows)
    if request_.pop("right_padded", False):
        ids, mask = ids.flip(-1), mask.flip(-1)
    if request_.pop("all_padding", False):
        mask = mask.clone()
        mask[1] = 0  # a row of nothing but padding: said so, not taken for right padding
    config = {"tiered": ViaSDConfig(mode="tiered", use_slim=False),
              None: ViaSDConfig(use_slim=False)}[request_.pop("viasd_config", None)]
    kwargs = {"assistant_model": assistant, "max_new_tokens": 4, "return_dict_in_generate": True} | GREEDY | request_
    with pytest.raises(ValueError, match=match):
        target.generate(ids, attention_mask=mask, viasd_config=config, **kwargs)


# -- real checkpoints ----------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.xdist_group("qwen-near_pair")  # the worker that already holds the near_pair (tests/test_decoding_zoo.py)
def test_qwen_coder_pair_batched_equals_each_prompt_alone():
    """Two code prompts of different lengths (so one is left-padded) through the Qwen2.5-Coder 1.5B ← 0.5B near_pair in
    float32, with the slim tier repairing drafts: each batched row is what greedy ``generate`` gives that prompt alone
    (up to a numerical near-tie of the target's), and the batch took fewer full passes than it made tokens."""
    target, tokenizer = zoo("qwen2.5-coder-1.5b-instruct")
    drafter, _ = zoo("qwen2.5-coder-0.5b-instruct")
    enable_viasd(target)
    texts = ["def reverse(s):", "def is_prime(n: int) -> bool:"]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert len(set(batch["attention_mask"].sum(-1).tolist())) == len(texts), "the prompts differ in length"
    mask = RoutingMask.from_model(target, skip=[4, 8, 12], drafter_id="qwen2.5-coder-0.5b-instruct")
    config = ViaSDConfig.paper(mode="lossless", routing_mask=mask, adaptive=False)
    settings = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}
    out = target.generate(**batch, assistant_model=drafter, viasd_config=config, **settings)
    stats = out.viasd_stats
    assert stats.batch_size == len(texts) and stats.slim_forwards > 0
    assert stats.decode_full_forwards < stats.new_tokens
    for i, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        reference = target.generate(ids, viasd_config=None, output_logits=True, **settings)
        expected = reference.sequences[0, ids.shape[1] :]
        row = out.sequences[i, batch["input_ids"].shape[1] :][: len(expected)]
        tie = first_near_tie(reference.logits)
        compared = len(expected) if tie is None or torch.equal(row, expected) else tie
        if compared < len(expected):
            NEAR_TIE_REPORT.append(f"qwen-near_pair batch row {i}: compared the first {tie} of {len(expected)} tokens")
        assert torch.equal(row[:compared], expected[:compared]), f"row {i}"
