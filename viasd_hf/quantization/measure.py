"""Measuring a scheme on one model: speed next to bf16 and agreement with the float32 model.

Every scheme is loaded in turn next to the unquantised bf16 model, timed in rounds alternating
with it (1-token decode passes and ``verify_tokens``-token verify passes over a KV cache of
``context`` tokens, so both see the same machine load) and compared with the unquantised float32
model on a few Spec-Bench prompts, or, for a drafter, with the float32 *target* it drafts for
(``MeasureOptions.judge``): a drafter's output only matters through what its target keeps.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DynamicCache

from ..cache import crop_to
from ..calibration import encode_prompt, spec_bench_prompts, split_prompts
from ..zoo import ZOO, resolve_zoo_model
from .invariance import batch_invariant
from .schemes import BASELINE, SCHEMES, QuantizationError, Scheme, get_scheme, load_in


@dataclass(frozen=True)
class Measurement:
    """One scheme on one model: speed relative to bf16, and agreement with the unquantised float32 model.

    ``decode_ms`` / ``verify_ms`` are medians of 1-token and ``verify_tokens``-token passes over a
    KV cache of ``context`` tokens; the ratios compare them with bf16 passes timed alternately in
    the same rounds. ``top1`` is the share of positions whose argmax matches the float32 model and
    ``kl`` the mean KL(float32 ‖ scheme) of the next-token distributions, teacher-forced on the
    calibration prompts. With a judge, both compare with the judge's float32 model instead, and
    ``judge_bytes`` is the bytes a bf16 pass of this model reads per byte a bf16 pass of the judge
    reads (a drafter pass in verifying passes, as ``draft_planner.StaticCosts`` prices it).
    ``batch_invariant`` is the scheme's verdict on this machine (:mod:`.invariance`; None for bf16).
    """

    scheme: str
    decode_ms: float | None = None
    verify_ms: float | None = None
    decode_ratio: float | None = None
    verify_ratio: float | None = None
    top1: float | None = None
    kl: float | None = None
    judge_bytes: float | None = None
    batch_invariant: bool | None = None
    error: str | None = None

    @property
    def cost(self) -> float:
        """Time relative to bf16, a decode pass and a verify pass weighed alike (a drafter step and a verification)."""
        return (self.decode_ratio + self.verify_ratio) / 2


@dataclass(frozen=True)
class MeasureOptions:
    """What is measured; part of the cache key."""

    prompts: int = 4
    prompt_tokens: int = 96
    context: int = 256
    verify_tokens: int = 6
    repeats: int = 5
    threads: int = field(default_factory=torch.get_num_threads)
    judge: str | None = None  # agreement with this model (a drafter's target) instead of the model's own float32


def _source(name_or_path: str) -> str | Path:
    return resolve_zoo_model(name_or_path) if name_or_path in ZOO and not Path(name_or_path).is_dir() else name_or_path


def calibration_windows(name_or_path: str, options: MeasureOptions) -> list[torch.Tensor]:
    """A few Spec-Bench prompts, one per category, as the model's chat template renders them."""
    tokenizer = AutoTokenizer.from_pretrained(_source(name_or_path))
    if options.judge and AutoTokenizer.from_pretrained(_source(options.judge)).get_vocab() != tokenizer.get_vocab():
        raise QuantizationError(
            f"{name_or_path} and {options.judge} tokenize differently: a drafter can only be judged by a target that "
            "shares its tokenizer; measure it without a judge"
        )
    prompts, _ = split_prompts(spec_bench_prompts(), options.prompts, 0)
    return [torch.tensor([encode_prompt(tokenizer, p.text, options.prompt_tokens)]) for p in prompts]


@torch.no_grad()
def _log_probs(model: nn.Module, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [model(ids, use_cache=False).logits[0].float().log_softmax(-1) for ids in windows]


def _agreement(
    reference: Sequence[torch.Tensor], model: nn.Module, windows: Sequence[torch.Tensor]
) -> dict[str, float]:
    matches, kl, positions = 0, 0.0, 0
    for ref, ours in zip(reference, _log_probs(model, windows)):
        vocabulary = min(ref.shape[-1], ours.shape[-1])  # a drafter and its target may pad their heads differently
        ref, ours = ref[:, :vocabulary], ours[:, :vocabulary]
        matches += int((ref.argmax(-1) == ours.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - ours)).sum())
        positions += ref.shape[0]
    return {"top1": matches / positions, "kl": kl / positions}


def _parameter_count(model: nn.Module) -> int:
    """Parameters, standing for the bytes a pass reads when both models are in the same dtype."""
    return sum(parameter.numel() for parameter in model.parameters())


class _Timed:
    """A loaded model with a KV cache of the context: times decode and verify passes, cropping back after each."""

    def __init__(self, model: nn.Module, context: torch.Tensor, block: torch.Tensor) -> None:
        self.model, self.context, self.block, self.length = model, context, block, context.shape[1]
        self.cache = DynamicCache(config=model.config)
        self.decode: list[float] = []
        self.verify: list[float] = []
        with torch.no_grad():
            model(context, past_key_values=self.cache, use_cache=True)

    @torch.no_grad()
    def _time(self, ids: torch.Tensor) -> float:
        start = time.perf_counter()
        self.model(ids, past_key_values=self.cache, use_cache=True)
        elapsed = time.perf_counter() - start
        crop_to(self.cache, self.length)
        return elapsed

    def round(self) -> tuple[float, float]:
        return self._time(self.block[:, :1]), self._time(self.block)

    def timed_round(self) -> None:
        decode, verify = self.round()
        self.decode.append(decode)
        self.verify.append(verify)

    def medians_ms(self, since: int = 0) -> tuple[float, float]:
        return 1e3 * statistics.median(self.decode[since:]), 1e3 * statistics.median(self.verify[since:])


def _context(windows: Sequence[torch.Tensor], options: MeasureOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``context`` tokens of the windows (repeated if short) and the next ``verify_tokens``."""
    ids = torch.cat(list(windows), dim=1)
    needed = options.context + options.verify_tokens
    ids = ids.repeat(1, -(-needed // ids.shape[1]))[:, :needed]
    return ids[:, : options.context], ids[:, options.context :]


def _measure_scheme(
    source: str | Path,
    scheme: Scheme,
    reference: Sequence[torch.Tensor],
    windows: Sequence[torch.Tensor],
    baseline: _Timed,
    options: MeasureOptions,
) -> dict[str, float]:
    """Agreement, then ``repeats`` rounds alternating with ``baseline`` (who goes first alternates too)."""
    model = load_in(source, scheme)
    result = _agreement(reference, model, windows)
    timed = _Timed(model, baseline.context, baseline.block)
    timed.round()  # warm-up
    since = len(baseline.decode)
    for r in range(options.repeats):
        for each in (timed, baseline) if r % 2 else (baseline, timed):
            each.timed_round()
    (decode, verify), (base_decode, base_verify) = timed.medians_ms(), baseline.medians_ms(since)
    return result | {"decode_ms": decode, "verify_ms": verify,
                     "decode_ratio": decode / base_decode, "verify_ratio": verify / base_verify}  # fmt: skip


def measure(
    name_or_path: str,
    schemes: Sequence[str] | None = None,
    options: MeasureOptions | None = None,
    windows: Sequence[torch.Tensor] | None = None,
    progress: bool = True,
) -> list[Measurement]:
    """Measure the bf16 baseline and ``schemes`` (default: all) on one model.

    The bf16 model stays loaded; each scheme is loaded in turn, timed in rounds alternating with
    bf16 (so both see the same machine load), then freed, so memory holds two models at a time.
    ``windows`` (token-id tensors of shape ``[1, n]``) default to :func:`calibration_windows`. A
    scheme whose library is missing or that fails to load or run gets a measurement with ``error``.
    """
    options = options or MeasureOptions()
    names = list(schemes) if schemes is not None else list(SCHEMES)
    if not names:
        raise QuantizationError("no schemes to measure; name at least one of: " + ", ".join(SCHEMES))
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        windows = list(windows) if windows is not None else calibration_windows(name_or_path, options)
        source = _source(name_or_path)
        judge = load_in(_source(options.judge) if options.judge else source, None)
        reference = _log_probs(judge, windows)
        judge_parameters = _parameter_count(judge)
        del judge
        gc.collect()
        context, block = _context(windows, options)
        baseline_model = load_in(source, BASELINE)
        judge_bytes = _parameter_count(baseline_model) / judge_parameters if options.judge else None
        results = {BASELINE.name: _agreement(reference, baseline_model, windows) | {"judge_bytes": judge_bytes}}
        baseline = _Timed(baseline_model, context, block)
        baseline.round()  # warm-up
        for name in tqdm(names, desc="quantization: measure", unit="scheme", disable=not progress):
            try:
                results[name] = _measure_scheme(source, get_scheme(name), reference, windows, baseline, options)
                results[name] |= {"judge_bytes": judge_bytes, "batch_invariant": batch_invariant(name)}
            except Exception as error:  # noqa: BLE001 — a scheme that cannot run on this machine is a result
                results[name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
            gc.collect()  # the scheme's model is garbage now: free it before loading the next
        decode, verify = baseline.medians_ms()
        results[BASELINE.name] |= {"decode_ms": decode, "verify_ms": verify, "decode_ratio": 1.0, "verify_ratio": 1.0}
        return [Measurement(scheme=name, **results[name]) for name in [BASELINE.name, *names]]
    finally:
        torch.set_num_threads(threads)
