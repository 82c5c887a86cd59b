"""Measuring the forms of one model on this machine: speed next to bf16, agreement with float32, quickly.

``auto`` measures on first use, so the work is cut to what can decide it:

1. *screen*: one MLP layer of the model's width (:mod:`.probe`, loaded in a second) times a one-token
   pass in each form; a form over ``screen_margin`` times slower than the fastest cannot win and is not
   loaded (bitsandbytes' CPU kernels without AVX512-BF16, say), which saves its minutes of quantising;
2. *rounds*: the model in each remaining form, and in bf16 (the baseline of every ratio), times 1-token
   decode passes and ``verify_tokens``-token verify passes over a KV cache of ``context`` tokens, the
   forms interleaved so all see the same machine load; from ``min_rounds`` on, a form whose passes take
   over ``losing`` times the fastest's stops;
3. *agreement*: the forms that ran every round are compared with the float32 model on a few Spec-Bench
   prompts or, for a drafter, with the float32 *target* it drafts for (``MeasureOptions.judge``): a
   drafter's output only matters through what its target keeps. Where agreement only informs (the
   unquantised forms of a model measured for itself, chosen by speed alone) it is measured on the first
   prompt, and the float32 form is the reference itself.

bf16 where it is emulated is slow to run over many tokens, so the unquantised forms' KV caches of the
context are cast from the float32 form's rather than recomputed.

A model can be measured from its checkpoint or in memory (its quantised forms then load from a copy saved once).
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, Cache, PretrainedConfig

from viasd_hf.calibration.windows import encode_prompt, spec_bench_prompts, split_prompts
from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.models.quantization.invariance import batch_invariant
from viasd_hf.models.quantization.probe import failure, ruled_out_by_screen, screen
from viasd_hf.models.quantization.schemes import (
    BASELINE,
    FORMS,
    SCHEMES,
    UNQUANTIZED,
    QuantizationError,
    Scheme,
    load_in,
)
from viasd_hf.models.zoo import ZOO, resolve_zoo_model

Loader = Callable[[Scheme | None], nn.Module]  # the model in a form; None: the float32 reference
FLOAT32 = "fp32"


@dataclass(frozen=True)
class Measurement:
    """One form of one model: speed relative to bf16, and agreement with the float32 model.

    ``layer_ms`` is the screen's one-token pass of one MLP layer. ``decode_ms`` / ``verify_ms`` are
    the fastest of the rounds' 1-token and ``verify_tokens``-token passes over a KV cache of
    ``context`` tokens (the least disturbed by other work); the ratios compare them with bf16 passes
    timed in the same rounds. ``top1`` is the share of positions
    whose argmax matches the float32 model and ``kl`` the mean KL(float32 ‖ form) of the next-token
    distributions, teacher-forced on the calibration prompts. With a judge, both compare with the
    judge's float32 model instead, and ``judge_bytes`` is the bytes a bf16 pass of this model reads
    per byte a bf16 pass of the judge reads (a drafter pass in verifying passes, as
    ``draft_planner.StaticCosts`` prices it). ``batch_invariant`` is a quantised scheme's verdict on
    this machine (:mod:`.invariance`). ``error`` says why a form has no agreement: it failed, the
    screen ruled it out, or it stopped early, clearly slower (its timings are then kept).
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
    layer_ms: float | None = None
    error: str | None = None

    @property
    def cost(self) -> float:
        """Time relative to bf16, a decode pass and a verify pass weighed alike (a drafter step and a verification)."""
        return (self.decode_ratio + self.verify_ratio) / 2


@dataclass(frozen=True)
class MeasureOptions:
    """What is measured, and when a form is given up; part of the cache key."""

    prompts: int = 4
    prompt_tokens: int = 96
    context: int = 256
    verify_tokens: int = 6
    repeats: int = 5  # rounds at most
    min_rounds: int = 2  # before a form may be stopped as losing
    losing: float = 1.3  # a form whose passes take this many times the fastest's stops
    screen_margin: float = 2.0  # a form whose layer pass takes this many times the fastest's is not loaded
    threads: int = field(default_factory=torch.get_num_threads)
    judge: str | None = None  # agreement with this model (a drafter's target) instead of the model's own float32


def source_of(name_or_path: str) -> str | Path:
    """Where a zoo name's checkpoint lives (fetched on first use); anything else as it is."""
    return resolve_zoo_model(name_or_path) if name_or_path in ZOO and not Path(name_or_path).is_dir() else name_or_path


def calibration_windows(name_or_path: str, options: MeasureOptions) -> list[torch.Tensor]:
    """A few Spec-Bench prompts, one per category, as the model's chat template renders them."""
    tokenizer = AutoTokenizer.from_pretrained(source_of(name_or_path))
    if options.judge and AutoTokenizer.from_pretrained(source_of(options.judge)).get_vocab() != tokenizer.get_vocab():
        raise QuantizationError(
            f"{name_or_path} and {options.judge} tokenize differently: a drafter can only be judged by a target that "
            "shares its tokenizer; measure it without a judge"
        )
    prompts, _ = split_prompts(spec_bench_prompts(), options.prompts, 0)
    return [torch.tensor([encode_prompt(tokenizer, p.text, options.prompt_tokens)]) for p in prompts]


def random_windows(config: PretrainedConfig, options: MeasureOptions) -> list[torch.Tensor]:
    """Token windows for a model without a tokenizer at hand (one in memory): agreement on them is only indicative."""
    vocabulary = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(vocabulary, (1, options.prompt_tokens), generator=generator) for _ in range(options.prompts)]


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
    """A loaded model with a KV cache of the context: times decode and verify passes, cropping back after each.

    ``seed``: the same model's cache of the context in another unquantised dtype, cast rather than recomputed (the
    timings do not depend on the cached values, and a bf16 prefill where bf16 is emulated takes half a minute)."""

    def __init__(self, model: nn.Module, context: torch.Tensor, block: torch.Tensor,
                 seed: Cache | None = None) -> None:
        self.model, self.block, self.length = model, block, context.shape[1]
        self.decode: list[float] = []
        self.verify: list[float] = []
        if seed is not None:
            self.cache = _cast(seed, model.dtype)
        else:
            self.cache = new_cache(model.config)  # its sliding layers (if any) can be cropped back after each pass
            with torch.no_grad():
                model(context, cache=self.cache, use_cache=True)
        self._time(block[:, :1])  # warm-up
        self._time(block)

    @torch.no_grad()
    def _time(self, ids: torch.Tensor) -> float:
        start = time.perf_counter()
        self.model(ids, cache=self.cache, use_cache=True)
        elapsed = time.perf_counter() - start
        crop_to(self.cache, self.length)
        return elapsed

    def timed_round(self) -> None:
        self.decode.append(self._time(self.block[:, :1]))
        self.verify.append(self._time(self.block))

    def best_ms(self) -> tuple[float, float]:
        """The fastest decode and verify pass: the one least disturbed by other work on the machine."""
        return 1e3 * min(self.decode), 1e3 * min(self.verify)

    def pass_ms(self) -> float:
        return sum(self.best_ms()) / 2


def _cast(cache: Cache, dtype: torch.dtype) -> Cache:
    """A copy of ``cache`` holding its keys and values in ``dtype``. Each layer is copied as it is, bookkeeping and all:
    a sliding-window layer holds only its window but counts every token it was fed, and crops and sizes its masks by
    that count, so refilling a fresh layer with the window's keys would leave it counting the wrong tokens."""
    cast = copy.copy(cache)
    cast.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in cast.layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    return cast


def _context(windows: Sequence[torch.Tensor], options: MeasureOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``context`` tokens of the windows (repeated if short) and the next ``verify_tokens``."""
    ids = torch.cat(list(windows), dim=1)
    needed = options.context + options.verify_tokens
    ids = ids.repeat(1, -(-needed // ids.shape[1]))[:, :needed]
    return ids[:, : options.context], ids[:, options.context :]


def time_in_rounds(timed: dict[str, _Timed], options: MeasureOptions, bar: tqdm) -> dict[str, str]:
    """Interleaved rounds (the order rotates); returns why each form that stopped early stopped."""
    running, stopped = list(timed), {}
    for r in range(options.repeats):
        for name in running[r % len(running) :] + running[: r % len(running)]:
            timed[name].timed_round()
        bar.update(1)
        if r + 1 < options.min_rounds:
            continue
        fastest = min(timed[name].pass_ms() for name in running)
        for name in list(running):
            if name not in UNQUANTIZED and timed[name].pass_ms() > options.losing * fastest:  # see ruled_out_by_screen
                running.remove(name)
                stopped[name] = f"stopped after {r + 1} rounds: {timed[name].pass_ms() / fastest:.2f}× the fastest pass"
    return stopped


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _reference(
    load: Loader, judge: Loader | None, windows: Sequence[torch.Tensor], keep_fp32: bool
) -> tuple[list[torch.Tensor], int | None, dict[str, nn.Module]]:
    """The reference log-probs, the judge's parameter count (None without one) and, when ``keep_fp32``, the model's
    own float32 reference as its fp32 form, so that it is not loaded twice."""
    reference_model = (judge or load)(None)
    reference = _log_probs(reference_model, windows)
    judge_parameters = _parameter_count(reference_model) if judge else None
    kept = {FLOAT32: reference_model} if keep_fp32 and not judge else {}
    return reference, judge_parameters, kept


def judged_windows(name: str, windows: Sequence[torch.Tensor], judged: bool) -> int:
    """How many windows a form's agreement is measured on: all of them where agreement decides (a quantised form, a
    drafter judged by its target), one where it is only shown (an unquantised form of a model measured for itself is
    chosen by speed alone; a bf16 pass over four prompts where bf16 is emulated takes a minute)."""
    return len(windows) if judged or name in SCHEMES else min(1, len(windows))


def _loaded_and_timed(
    load: Loader, names: Sequence[str], models: dict[str, nn.Module], ids: tuple[torch.Tensor, torch.Tensor], bar: tqdm
) -> tuple[dict[str, _Timed], dict[str, str]]:
    """Each form loaded (into ``models``) with its KV cache of the context, and why those that failed did."""
    timed, failed = {}, {}
    for name in sorted(names, key=lambda name: name != FLOAT32):  # float32 first: its cache seeds the other dtypes
        try:
            if name not in models:
                models[name] = load(FORMS[name])
            seed = timed[FLOAT32].cache if FLOAT32 in timed and name in UNQUANTIZED else None
            timed[name] = _Timed(models[name], *ids, seed=seed)
        except Exception as error:  # noqa: BLE001 — a form that cannot run on this machine is a result
            models.pop(name, None)
            failed[name] = failure(error)
        bar.update(1)
    if BASELINE.name not in timed:
        raise QuantizationError(f"bf16, the baseline of every ratio, cannot run here: {failed[BASELINE.name]}")
    return timed, failed


def measure_forms(
    load: Loader,
    config: PretrainedConfig,
    names: Sequence[str],
    options: MeasureOptions,
    windows: Sequence[torch.Tensor],
    judge: Loader | None = None,
    progress: bool = True,
) -> list[Measurement]:
    """bf16 and the forms ``names``, measured as the module says; ``judge`` loads the judge's float32 model."""
    if not names:
        raise QuantizationError("no forms to measure; name at least one of: " + ", ".join(FORMS))
    names = [BASELINE.name, *(name for name in names if name != BASELINE.name)]
    stages = 2 + len(names) + options.repeats  # the screen, the reference, each form's load, each round
    with _threads(options.threads), tqdm(total=stages, desc="precision: measure", disable=not progress) as bar:
        layer = screen(config, names)
        ruled_out = ruled_out_by_screen(layer, options.screen_margin)
        bar.update(1)
        judged = {name: judged_windows(name, windows, judge is not None) for name in names if name not in ruled_out}
        windows = windows[: max(judged.values())]
        reference, judge_parameters, models = _reference(load, judge, windows, keep_fp32=FLOAT32 in names)
        bar.update(1)
        loading = [name for name in names if name not in ruled_out]
        timed, failed = _loaded_and_timed(load, loading, models, _context(windows, options), bar)
        stopped = time_in_rounds(timed, options, bar)
        judge_bytes = _parameter_count(models[BASELINE.name]) / judge_parameters if judge else None
        base_decode, base_verify = timed[BASELINE.name].best_ms()
        results = []
        for name in names:
            fields = {"layer_ms": layer[name] if isinstance(layer[name], float) else None, "judge_bytes": judge_bytes,
                      "batch_invariant": batch_invariant(name) if name in SCHEMES and name in timed else None}
            if name in timed:
                decode, verify = timed[name].best_ms()
                fields |= {"decode_ms": decode, "verify_ms": verify,
                           "decode_ratio": decode / base_decode, "verify_ratio": verify / base_verify}  # fmt: skip
            error = ruled_out.get(name) or failed.get(name) or stopped.get(name)
            if error is None and name == FLOAT32 and not judge:
                fields |= {"top1": 1.0, "kl": 0.0}  # the reference itself
            elif error is None:
                fields |= _agreement(reference, models[name], windows[: judged[name]])
            results.append(Measurement(scheme=name, error=error, **fields))
        return results


def measure(
    name_or_path: str,
    schemes: Sequence[str] | None = None,
    options: MeasureOptions | None = None,
    windows: Sequence[torch.Tensor] | None = None,
    progress: bool = True,
) -> list[Measurement]:
    """bf16 and ``schemes`` (default: every quantised scheme) of one checkpoint, as :func:`measure_forms` does.

    ``windows`` (token-id tensors of shape ``[1, n]``) default to :func:`calibration_windows`.
    """
    options = options or MeasureOptions()
    source = source_of(name_or_path)
    windows = list(windows) if windows is not None else calibration_windows(name_or_path, options)
    judge = (lambda _: load_in(source_of(options.judge), None)) if options.judge else None
    return measure_forms(lambda form: load_in(source, form), AutoConfig.from_pretrained(source),
                         list(schemes) if schemes is not None else list(SCHEMES), options, windows, judge, progress)


def converted(model: nn.Module, form: Scheme | None, checkpoint: Path | None = None) -> nn.Module:
    """A copy of an unquantised model in another form (None: float32), or the model if it is in that unquantised form
    already. A quantised form is made as loading makes it, from the model saved with ``save_pretrained``: in
    ``checkpoint`` when given (so several forms share one save), else in a folder of its own, removed afterwards."""
    if form is not None and form.name not in UNQUANTIZED:
        with nullcontext(checkpoint) if checkpoint is not None else saved_checkpoint(model) as folder:
            loaded = load_in(folder, form)
        loaded.config._name_or_path = model.config._name_or_path  # the name masks and vocabularies are found by
        loaded.name_or_path = getattr(model, "name_or_path", model.config._name_or_path)
        return loaded
    dtype = form.dtype if form else torch.float32
    return model if model.dtype == dtype else copy.deepcopy(model).to(dtype).eval()


@contextmanager
def saved_checkpoint(model: nn.Module) -> Iterator[Path]:
    """The model saved in a temporary folder (its config and safetensors weights), removed on leaving. Written on every
    rank of a distributed run, where ``save_pretrained`` writes on rank 0 alone (``should_save_on_this_rank``: a
    checkpoint the ranks share); this folder is the process's own, and every rank converts its own drafter."""
    with tempfile.TemporaryDirectory(prefix="viasd-form-") as folder:
        model.__dict__["should_save_on_this_rank"] = lambda is_main_process: is_main_process
        try:
            model.save_pretrained(folder)
        finally:
            del model.__dict__["should_save_on_this_rank"]
        yield Path(folder)


def measure_in_memory(
    model: nn.Module, names: Sequence[str], options: MeasureOptions | None = None, progress: bool = True
) -> list[Measurement]:
    """bf16 and the forms ``names`` of a model in memory (copies; the model is left as it is; quantised forms from one
    saved checkpoint). Agreement is measured on random tokens, so it only shows that a form computes the same model."""
    options = options or MeasureOptions()
    quantised = any(name in SCHEMES for name in names)
    with saved_checkpoint(model) if quantised else nullcontext() as checkpoint:
        return measure_forms(lambda form: converted(model, form, checkpoint), model.config, names, options,
                             random_windows(model.config, options), progress=progress)  # fmt: skip
