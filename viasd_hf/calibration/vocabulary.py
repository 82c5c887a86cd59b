"""Building a draft vocabulary: count what the target writes, measure coverage and head cost, choose V.

1. **Count.** The target's own greedy continuations of calibration prompts from the stratified
   corpus (``viasd_hf.calibration.corpus``: chat, translation, summarisation, QA, maths and code), counted per
   token. A few thousand tokens cannot rank 150k ids, so ties are broken by how often the token
   occurs in the corpus's prompts (continuations copy from their prompts: names, code, numbers),
   then by token id (byte-pair merges are numbered roughly by frequency in the tokenizer's own
   training text). The tokenizer's special tokens and the model's stop tokens always come first.
2. **Coverage.** The target's continuations of held-out prompts (the corpus's held-out split,
   whose prompts are not counted): for each candidate size V, the share of their tokens among the
   first V ids. A drafter over the vocabulary can never propose the others.
3. **Cost.** One forward pass of the cost model (the drafter, else the target) with V rows of its
   LM head, relative to the full head: the body once, then each head, timed on this machine.
4. **Choose.** V minimising ``cost(V) / coverage(V) ** block``: the drafter's cost per drafted
   token over the chance that a whole block of ``block`` target tokens lies in the vocabulary (a
   token outside it ends the block, so coverage counts once per token of the block).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from viasd_hf.calibration.corpus import pool, stratified_corpus
from viasd_hf.calibration.windows import continuations, stop_token_ids
from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.masks.architectures import base_model, config_fingerprint, model_config
from viasd_hf.vocabulary.head import SubsetHead
from viasd_hf.vocabulary.store import DraftVocabulary, lm_head_rows

DEFAULT_SIZES = (8192, 16384, 24576, 32768, 49152, 65536)


def rank_tokens(rows: int, first: Iterable[int], counts: Counter, tie_breaks: Counter, tokenizer_size: int) -> list[int]:
    """Every id of an LM head of ``rows`` rows, best first: ``first``, then by ``counts``, ``tie_breaks``, id.

    Rows beyond the tokenizer (padding of the head) come last: no text ever produces them.
    """
    first = set(first)
    return sorted(range(rows), key=lambda t: (t not in first, t >= tokenizer_size, -counts[t], -tie_breaks[t], t))


def coverage(ranking: Sequence[int], heldout: Sequence[int], sizes: Sequence[int]) -> dict[int, float]:
    """Per size V, the share of the ``heldout`` tokens among the first V ids of ``ranking``."""
    if not heldout:
        raise ValueError("no held-out tokens to measure coverage on: ask for at least one held-out prompt per family")
    rank = {token: position for position, token in enumerate(ranking)}
    return {size: sum(rank[token] < size for token in heldout) / len(heldout) for size in sizes}


def choose_size(coverages: dict[int, float], costs: dict[int, float], block: int) -> tuple[int, dict[int, float]]:
    """The size with the lowest ``cost / coverage ** block`` (the smaller on a tie), and every size's score."""
    scores = {size: costs[size] / max(coverages[size], 1e-9) ** block for size in coverages}
    return min(scores, key=lambda size: (scores[size], size)), scores


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: the sliced weight is made on the first call
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.no_grad()
def head_costs(
    model: nn.Module, ranking: Sequence[int], sizes: Sequence[int], context: int = 128, repeats: int = 9,
    progress: bool = True,
) -> dict[int, float]:
    """Per size V, one 1-token forward with V LM-head rows relative to one with the full head (this machine).

    The body is timed once (after a KV cache of ``context`` tokens, cropped back after each pass)
    and each head on its output, so the noise of a shared machine enters the body's time once.
    """
    cache = new_cache(model_config(model))
    body = base_model(model).get_decoder()
    lm_head = base_model(model).get_output_embeddings()
    device = lm_head.weight.device
    prefix = torch.tensor([list(ranking[:context])], device=device)
    body(input_ids=prefix, cache=cache, use_cache=True)
    token = torch.tensor([[ranking[0]]], device=device)

    def body_pass() -> torch.Tensor:
        hidden = body(input_ids=token, cache=cache, use_cache=True).last_hidden_state[0]
        crop_to(cache, context)
        return hidden

    body_seconds = _median_seconds(body_pass, repeats)
    hidden = body_pass()
    full_seconds = _median_seconds(lambda: lm_head(hidden), repeats)
    costs = {}
    for size in tqdm(sizes, desc="vocabulary: head cost", unit="size", disable=not progress):
        if size >= lm_head_rows(model):
            costs[size] = 1.0
            continue
        head = SubsetHead(model, ranking[:size])
        costs[size] = (body_seconds + _median_seconds(lambda: head.spread(hidden), repeats)) / (body_seconds + full_seconds)
    return costs


def prompt_token_counts(tokenizer: PreTrainedTokenizerBase, excluded: set[str]) -> Counter:
    """How often each token occurs in the corpus's prompts, the ``excluded`` prompt ids (held out) left out."""
    counts: Counter = Counter()
    for strata in pool().values():
        for entries in strata.values():
            texts = [entry.prompt.text for entry in entries if entry.prompt.id not in excluded]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
                counts.update(ids)
    return counts


def build_vocabulary(
    target: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cost_model: nn.Module | None = None,
    drafter_id: str = "self",
    per_family: int = 8,
    heldout_per_family: int = 2,
    max_new_tokens: int = 48,
    max_prompt_tokens: int = 384,
    sizes: Sequence[int] = DEFAULT_SIZES,
    block: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> DraftVocabulary:
    """Count, measure and choose as the module docstring says; the vocabulary of ``target`` for ``drafter_id``.

    ``cost_model`` is the model whose head cost decides V (the drafter model; the target when ``None``).
    Continuations are cached on disk (``viasd_hf.calibration.windows``), so a rebuild with other sizes is quick.
    """
    rows = lm_head_rows(target)
    sizes = sorted({min(int(size), rows) for size in sizes})
    corpus = stratified_corpus(validation=0, calibration=per_family, heldout=heldout_per_family, seed=seed)
    counted_prompts, heldout_prompts = corpus.prompts("calibration"), corpus.prompts("heldout")
    counted = _continued_tokens(target, tokenizer, counted_prompts, max_new_tokens, max_prompt_tokens, progress)
    heldout = _continued_tokens(target, tokenizer, heldout_prompts, max_new_tokens, max_prompt_tokens, progress)
    first = set(tokenizer.all_special_ids) | stop_token_ids(target, tokenizer)
    tie_breaks = prompt_token_counts(tokenizer, {prompt.id for prompt in heldout_prompts})
    ranking = rank_tokens(rows, first, Counter(counted), tie_breaks, len(tokenizer))
    coverages = coverage(ranking, heldout, sizes)
    costs = head_costs(cost_model if cost_model is not None else target, ranking, sizes, progress=progress)
    size, scores = choose_size(coverages, costs, block)
    config = model_config(target)
    cost_config = model_config(cost_model if cost_model is not None else target)
    return DraftVocabulary(
        token_ids=ranking[:size],
        vocab_size=rows,
        target_id=str(getattr(config, "_name_or_path", "") or type(target).__name__),
        target_fingerprint=config_fingerprint(target),
        tokenizer_size=len(tokenizer),
        target_revision=getattr(config, "_commit_hash", None),
        drafter_id=drafter_id,
        coverage={str(k): round(v, 5) for k, v in coverages.items()},
        head_cost={str(k): round(v, 4) for k, v in costs.items()},
        cost_model_id=str(getattr(cost_config, "_name_or_path", "")),
        counted=(
            f"{len(counted)} tokens ({len(set(counted))} distinct) of the target's greedy continuations "
            f"(up to {max_new_tokens} tokens) of {len(counted_prompts)} prompts of the {corpus.describe()}, "
            f"calibration split; ties broken by the corpus's prompts (held-out prompts left out), then by token id. "
            f"Coverage on {len(heldout)} continuation tokens of its {len(heldout_prompts)} held-out prompts"
        ),
        metadata=_choice_record(scores, block, dtype=str(next(target.parameters()).dtype)),
    )


def _continued_tokens(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list, length: int, max_prompt_tokens: int,
    progress: bool,
) -> list[int]:
    """Every token of the target's greedy continuations of ``prompts`` (cached on disk by ``calibration``)."""
    windows = continuations(model, tokenizer, prompts, length, max_prompt_tokens, progress)
    return [token for window in windows for token in window.tokens[0, window.start + 1 :].tolist()]


def _choice_record(scores: dict[int, float], block: int, dtype: str) -> dict[str, Any]:
    return {
        "chosen_by": f"min over sizes of head_cost / coverage ** {block}",
        "score": {str(k): round(v, 4) for k, v in scores.items()},
        "counted_in_dtype": dtype,
    }
