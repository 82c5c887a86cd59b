"""Calibration windows for DIMR: prompts, the target's own greedy continuation, and its log-probs.

DIMR scores many candidate masks against the full model q (docs/design.md, "DIMR"). Each candidate costs one
slim pass, so everything that does not depend on the mask is done once: the target's greedy
continuation of every prompt (slow — cached on disk, keyed by the target and the prompts, so a
search can be re-run), and, per search process, the full model's KV cache of each window's prefix
and its log-probabilities over the window (``TeacherForcedReference``).

A window is scored the way the slim verifier runs when decoding: it reads the full model's
committed prefix from the KV cache and scores a block in one teacher-forced pass. The block here
is the τ continuation tokens, longer than a decoding block (γ ≈ 5), so later tokens see more of
the slim model's own keys and values — a slightly pessimistic, but cheap, proxy. Windows may also
start ``depths`` tokens into the continuation, so that later positions are scored too.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedTokenizerBase

from viasd_hf.data.datasets import SPEC_BENCH_ENV, spec_bench_path, spec_bench_records
from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.hub.files import viasd_home
from viasd_hf.masks.architectures import config_fingerprint, model_config
from viasd_hf.masks.layer_skipping import routed
from viasd_hf.masks.routing_mask import RoutingMask

CACHE_FORMAT = 1
REFERENCE_BYTES = 1 << 30  # keep full-vocabulary log q in float32 up to this size, else float16


@dataclass(frozen=True)
class Prompt:
    """One calibration prompt; ``id`` is recorded in the mask so the split can be checked."""

    id: str
    text: str
    category: str | None = None


@dataclass(frozen=True)
class Window:
    """Prompt + greedy continuation; the predictions of ``tokens[0, start + 1:]`` are scored.

    ``tokens[:, :start]`` is the committed prefix (read from the full model's cache) and
    ``tokens[:, start:-1]`` the block a verifier pass feeds in, last committed token first.
    """

    prompt_id: str
    tokens: torch.Tensor
    start: int
    depth: int = 0  # continuation tokens already committed before the scored block

    @property
    def positions(self) -> int:
        return self.tokens.shape[1] - self.start - 1


@dataclass(frozen=True)
class Calibration:
    """Search windows and disjoint held-out windows, with a description that goes into the mask."""

    windows: list[Window]
    heldout: list[Window]
    source: str
    window: int
    max_prompt_tokens: int
    depths: tuple[int, ...] = (0,)
    families: dict[str, str] = field(default_factory=dict)  # prompt id -> task family (stratified corpus only)

    @property
    def calibration_ids(self) -> list[str]:
        return prompt_ids(self.windows)

    @property
    def heldout_ids(self) -> list[str]:
        return prompt_ids(self.heldout)

    def describe(self) -> str:
        positions = sum(w.positions for w in self.windows)
        depths = "" if self.depths == (0,) else f", windows at continuation depths {','.join(map(str, self.depths))}"
        return (
            f"{len(self.calibration_ids)} prompts from {self.source} + the target's greedy continuation "
            f"(τ={self.window} tokens{depths}, prompts cut at {self.max_prompt_tokens} tokens; {positions} positions); "
            f"{len(self.heldout_ids)} disjoint held-out prompts. Calibration ids: {','.join(self.calibration_ids)}; "
            f"held-out ids: {','.join(self.heldout_ids)}"
        )


def prompt_ids(windows: Sequence[Window]) -> list[str]:
    """The prompts behind ``windows``, each once, in order (a prompt has one window per depth)."""
    return list(dict.fromkeys(w.prompt_id for w in windows))


# --------------------------------------------------------------------------- prompts


def spec_bench_prompts(path: str | Path | None = None) -> list[Prompt]:
    """First turns of the Spec-Bench questions, with their categories (the task mix in docs/design.md, "Benchmarking"),
    from ``path``, else ``$VIASD_SPEC_BENCH``, else the evaluation data."""
    path = Path(path) if path else spec_bench_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"Spec-Bench prompts not found at {path}; set ${SPEC_BENCH_ENV} or pass your own prompts "
            "(a JSONL file with a 'prompt' field, or a text file with one prompt per line)"
        )
    return [Prompt(str(r["question_id"]), r["turns"][0], r.get("category")) for r in spec_bench_records(path)]


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file (``prompt`` field, optional ``id``/``category``) or one per line of text."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in lines]
        if "turns" in records[0]:  # a Spec-Bench style file
            return spec_bench_prompts(path)
        return [Prompt(str(r.get("id", i)), r["prompt"], r.get("category")) for i, r in enumerate(records)]
    return [Prompt(str(i), line) for i, line in enumerate(lines)]


def split_prompts(
    prompts: Sequence[Prompt], num_calibration: int, num_heldout: int, seed: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic, disjoint calibration / held-out split, stratified by category.

    Each category is shuffled with ``seed`` and the categories are interleaved round-robin, so
    both sets cover the task mix; the first ``num_calibration`` go to calibration, the next
    ``num_heldout`` are held out.
    """
    if num_calibration + num_heldout > len(prompts):
        raise ValueError(f"asked for {num_calibration} + {num_heldout} prompts, but only {len(prompts)} are available")
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category or "", []).append(prompt)
    rng = random.Random(seed)
    for name in sorted(groups):
        rng.shuffle(groups[name])
    order = [group[i] for i in range(max(map(len, groups.values()))) for _, group in sorted(groups.items()) if i < len(group)]
    return order[:num_calibration], order[num_calibration : num_calibration + num_heldout]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of ``text`` as the model sees it when deployed: chat template if the tokenizer has one.

    Long prompts are cut to their first ``max_prompt_tokens`` tokens *before* templating, so the
    template stays intact.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_prompt_tokens:
        text = tokenizer.decode(ids[:max_prompt_tokens])
    if getattr(tokenizer, "chat_template", None):
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(templated, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)


# --------------------------------------------------------------------------- continuations


def stop_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


@torch.no_grad()
def greedy_continuation(model: nn.Module, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """The target's own greedy continuation (up to and including a stop token)."""
    cache = DynamicCache(config=model_config(model))
    logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits
    continuation: list[int] = []
    while len(continuation) < max_new_tokens:
        token = int(logits[0, -1].argmax())
        continuation.append(token)
        if token in stop:
            break
        logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits
    return continuation


def weights_probe(model: nn.Module) -> str:
    """A hash of a few embedding weights, so two checkpoints with the same config never share a cache."""
    embedding = model.get_input_embeddings().weight
    return hashlib.sha256(embedding[:4, :64].detach().float().numpy().tobytes()).hexdigest()[:16]


def target_identity(model: nn.Module) -> dict[str, Any]:
    config = model_config(model)
    return {
        "name": str(getattr(config, "_name_or_path", "")),
        "revision": getattr(config, "_commit_hash", None),
        "fingerprint": config_fingerprint(model),
        "weights": weights_probe(model),
        "dtype": str(next(model.parameters()).dtype),
    }


def cache_path(model: nn.Module, tokenizer: Any, prompts: Sequence[Prompt], window: int, max_prompt_tokens: int) -> Path:
    """``$VIASD_HOME/calibration/<hash>.pt`` for this target, these prompts and these parameters."""
    key = {
        "format": CACHE_FORMAT,
        "target": target_identity(model),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "prompts": [[p.id, p.text] for p in prompts],
        "window": window,
        "max_prompt_tokens": max_prompt_tokens,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return viasd_home() / "calibration" / f"{digest}.pt"


def build_windows(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    window: int = 16,
    max_prompt_tokens: int = 384,
    progress: bool = True,
    depths: Sequence[int] = (0,),
) -> list[Window]:
    """Per prompt, one window of ``window`` greedy tokens of the target at each of ``depths`` into its continuation.

    Windows deeper into the continuation score the later positions a decoder spends most of its
    time at, which the first τ tokens after the prompt alone do not. The continuation
    (``max(depths) + window`` tokens) is cached on disk; a depth it does not reach (the target
    stopped earlier) gives no window.
    """
    if not depths or min(depths) < 0:
        raise ValueError(f"depths must be a non-empty list of whole numbers >= 0, got {list(depths)}")
    continued = continuations(model, tokenizer, prompts, max(depths) + window, max_prompt_tokens, progress)
    return [part for full in continued for part in at_depths(full, depths, window)]


def at_depths(full: Window, depths: Sequence[int], window: int) -> list[Window]:
    """``full`` (a depth-0 window) cut into windows of up to ``window`` scored tokens starting ``depths`` tokens in."""
    parts = []
    for depth in sorted(set(depths)):
        start = full.start + depth
        if start + 1 < full.tokens.shape[1]:
            parts.append(Window(full.prompt_id, full.tokens[:, : start + window + 1], start, depth))
    return parts


def continuations(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    length: int,
    max_prompt_tokens: int,
    progress: bool = True,
) -> list[Window]:
    """One depth-0 window per prompt: the prompt and ``length`` greedy tokens of the target, cached on disk."""
    path = cache_path(model, tokenizer, prompts, length, max_prompt_tokens)
    if path.is_file():
        stored = torch.load(path)
        return [Window(w["prompt_id"], w["tokens"], w["start"]) for w in stored["windows"]]
    stop = stop_token_ids(model, tokenizer)
    windows = []
    for prompt in tqdm(prompts, desc="calibration: greedy continuations", unit="prompt", disable=not progress):
        ids = encode_prompt(tokenizer, prompt.text, max_prompt_tokens)
        continuation = greedy_continuation(model, ids, length, stop)
        windows.append(Window(prompt.id, torch.tensor([ids + continuation]), start=len(ids) - 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial-{os.getpid()}")
    torch.save({"windows": [{"prompt_id": w.prompt_id, "tokens": w.tokens, "start": w.start} for w in windows]}, partial)
    os.replace(partial, path)
    return windows


def build_calibration(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: str | Path | Sequence[Prompt] | None = None,
    num_prompts: int = 32,
    num_heldout: int = 16,
    window: int = 16,
    max_prompt_tokens: int = 384,
    seed: int = 0,
    progress: bool = True,
    depths: Sequence[int] = (0,),
) -> Calibration:
    """Calibration and held-out windows from Spec-Bench (default), a prompt file, or a list of prompts."""
    if prompts is None:
        source, pool = f"Spec-Bench {spec_bench_path().name}", spec_bench_prompts()
    elif isinstance(prompts, (str, Path)):
        source, pool = str(prompts), read_prompts(prompts)
    else:
        source, pool = "user prompts", list(prompts)
    calibration, heldout = split_prompts(pool, num_prompts, num_heldout, seed)
    build = dict(window=window, max_prompt_tokens=max_prompt_tokens, progress=progress, depths=depths)
    return Calibration(
        windows=build_windows(model, tokenizer, calibration, **build),
        heldout=build_windows(model, tokenizer, heldout, **build) if heldout else [],
        source=source,
        window=window,
        max_prompt_tokens=max_prompt_tokens,
        depths=tuple(sorted(set(depths))),
    )


# --------------------------------------------------------------------------- the full model's reference


@dataclass
class _Scored:
    cache: DynamicCache  # the full model's cache of the window's prefix
    block: torch.Tensor
    log_q: torch.Tensor  # (positions, vocab)


class TeacherForcedReference:
    """The full model's prefix caches and log q for a set of windows, computed once per search.

    ``log q`` is kept over the whole vocabulary (exact KL and VIA cost); when that exceeds
    ``max_bytes`` in float32 (e.g. many windows of a 151,936-token vocabulary) it is stored in
    float16, which costs ~1e-3 relative error on log-probabilities.
    """

    def __init__(self, model: nn.Module, windows: Sequence[Window], max_bytes: int = REFERENCE_BYTES, progress: bool = True):
        if not windows:
            raise ValueError("no calibration windows")
        self.model = model
        self.windows = list(windows)
        vocab = model_config(model).vocab_size
        positions = sum(w.positions for w in self.windows)
        self.storage_dtype = torch.float32 if positions * vocab * 4 <= max_bytes else torch.float16
        self._scored = [
            self._score_window(window)
            for window in tqdm(self.windows, desc="calibration: full-model pass", unit="window", disable=not progress)
        ]

    @property
    def positions(self) -> int:
        return sum(w.positions for w in self.windows)

    @torch.no_grad()
    def _score_window(self, window: Window) -> _Scored:
        cache = new_cache(model_config(self.model))
        self.model(window.tokens[:, : window.start], cache=cache, use_cache=True)
        crop_to(cache, window.start)
        block = window.tokens[:, window.start : -1]
        log_q = self._block_log_probs(cache, block, window.start).to(self.storage_dtype)
        return _Scored(cache, block, log_q)

    def _block_log_probs(self, cache: DynamicCache, block: torch.Tensor, committed: int) -> torch.Tensor:
        logits = self.model(block, cache=cache, use_cache=True).logits[0]
        crop_to(cache, committed)
        return logits.float().log_softmax(-1)

    @torch.no_grad()
    def log_prob_pairs(self, mask: RoutingMask) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per window, ``(log q, log q′)`` in float32: the stored full model and one routed pass."""
        for window, scored in zip(self.windows, self._scored):
            with routed(self.model, mask):
                slim = self._block_log_probs(scored.cache, scored.block, window.start)
            yield scored.log_q.float(), slim

    @torch.no_grad()
    def drafter_log_probs(self, drafter: nn.Module) -> Iterator[torch.Tensor]:
        """Per window, the drafter's log p at the scored positions (it reads the whole window itself)."""
        for window in self.windows:
            logits = drafter(window.tokens[:, :-1], use_cache=False).logits[0, window.start :]
            yield logits.float().log_softmax(-1)
