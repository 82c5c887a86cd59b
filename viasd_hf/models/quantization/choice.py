"""Which form ``auto`` means on this machine: measured (:mod:`.measure`), never guessed.

Which kernel wins depends on the CPU's instruction set and the library versions. For a target,
``quantization="auto"`` picks the fastest quantised scheme that :class:`Acceptance` allows, else bf16;
``dtype="auto"`` the faster of fp32 and bf16. For a drafter, ``auto`` picks the form (unquantised or
quantised) with which its target decodes fastest (:mod:`.drafting`), and a drafter already in memory
runs in its fastest unquantised form (:func:`fastest_unquantized`). The measurements are cached as
JSON under ``$VIASD_HOME/quantization``, keyed by the model (for one in memory, its architecture:
speed depends on shapes, not weights), the CPU, the thread count, the library versions and the
measuring parameters, so a second ``auto`` is instant.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from viasd_hf.masks.architectures import config_fingerprint, model_config
from viasd_hf.models.machine import machine_key, native_fp16, read_record, record_path, write_record
from viasd_hf.models.quantization.drafting import DraftingAcceptance, drafting_throughput
from viasd_hf.models.quantization.measure import Measurement, MeasureOptions, measure, measure_in_memory
from viasd_hf.models.quantization.schemes import (
    ALIASES,
    AUTO,
    BASELINE,
    FORMS,
    SCHEMES,
    UNQUANTIZED,
    Scheme,
    get_scheme,
)
from viasd_hf.models.zoo import ZOO, zoo_revision

CACHE_FORMAT = 3


@dataclass(frozen=True)
class Acceptance:
    """When ``auto`` may pick a quantised scheme over bf16.

    Its next-token argmax may differ from the unquantised model's at no more than one position in
    ten, its mean KL stays below 0.1 nat, it must be at least 10 % faster than bf16 (a smaller gain
    is within the run-to-run noise of a busy machine and not worth the agreement it costs), and it
    must be batch-invariant on this machine (:mod:`.invariance`), so lossless VIA-SD stays lossless.
    """

    min_top1: float = 0.90
    max_kl: float = 0.10
    min_speedup: float = 1.10
    require_batch_invariant: bool = True

    def rejects(self, m: Measurement) -> str | None:
        """Why ``auto`` may not pick ``m`` (every reason), or None."""
        if m.error:
            return m.error
        reasons = []
        if self.require_batch_invariant and not m.batch_invariant:
            reasons.append("not batch-invariant")
        if m.top1 < self.min_top1:
            reasons.append(f"top-1 agreement {m.top1:.3f} < {self.min_top1}")
        if m.kl > self.max_kl:
            reasons.append(f"KL {m.kl:.3f} > {self.max_kl}")
        if m.cost * self.min_speedup > 1:
            reasons.append(f"{1 / m.cost:.2f}× the speed of bf16 < {self.min_speedup}×")
        return ", ".join(reasons) or None


@dataclass(frozen=True)
class QuantizationChoice:
    """The scheme a request resolved to, and why (with the measurements behind an ``auto`` choice)."""

    requested: str
    scheme: Scheme
    reason: str
    measurements: tuple[Measurement, ...] = ()

    @property
    def quantized(self) -> bool:
        return self.scheme.name in SCHEMES


def _fastest_allowed(
    measurements: Sequence[Measurement],
    rejects: Callable[[Measurement], str | None],
    speed: Callable[[Measurement], float],
    candidates: Collection[str] = FORMS,
) -> tuple[Measurement | None, str]:
    """The fastest of the ``candidates`` measured besides bf16 that ``rejects`` lets through (None if none does), and
    why the others may not."""
    verdicts = {m.scheme: rejects(m) for m in measurements if m.scheme != BASELINE.name and m.scheme in candidates}
    allowed = [m for m in measurements if m.scheme in verdicts and verdicts[m.scheme] is None]
    rejected = "; ".join(f"{name}: {why}" for name, why in verdicts.items() if why)
    return max(allowed, key=speed, default=None), rejected


def choose(measurements: Sequence[Measurement], acceptance: Acceptance = Acceptance()) -> tuple[str, str]:
    """``(scheme name, reason)``: the fastest scheme ``acceptance`` allows, else bf16."""
    best, rejected = _fastest_allowed(measurements, acceptance.rejects, lambda m: 1 / m.cost, SCHEMES)
    if best is None:
        return BASELINE.name, f"no quantised scheme qualifies ({rejected})"
    reason = f"the fastest that qualifies, {1 / best.cost:.2f}× the speed of bf16"
    return best.scheme, reason + (f" (not: {rejected})" if rejected else "")


def choose_drafter(
    measurements: Sequence[Measurement], acceptance: DraftingAcceptance = DraftingAcceptance()
) -> tuple[str, str]:
    """``(form name, reason)``: the form with which the judge decodes fastest (:mod:`.drafting`), if
    ``acceptance`` allows it, else bf16."""
    baseline = next(m for m in measurements if m.scheme == BASELINE.name)
    if baseline.judge_bytes is None:
        raise ValueError("a drafter's measurements must be judged by its target (MeasureOptions.judge)")
    best, rejected = _fastest_allowed(measurements, lambda m: acceptance.rejects(m, baseline), drafting_throughput)
    if best is None:
        return BASELINE.name, f"no other form qualifies ({rejected})"
    gain = drafting_throughput(best) / drafting_throughput(baseline)
    reason = (f"its target decodes {gain:.2f}× as fast as with the bf16 drafter (target agreement {best.top1:.3f} "
              f"vs {baseline.top1:.3f}, pass {best.decode_ratio:.2f}× bf16)")  # fmt: skip
    return best.scheme, reason + (f" (not: {rejected})" if rejected else "")


def fastest_unquantized(measurements: Sequence[Measurement]) -> tuple[str, str]:
    """``(form name, reason)``: the unquantised form whose passes are fastest (bf16 on a tie)."""
    timed = [m for m in measurements if m.scheme in UNQUANTIZED and m.decode_ratio is not None]
    best = min(timed, key=lambda m: (m.cost, m.scheme != BASELINE.name))
    others = ", ".join(f"{m.scheme} {m.cost / best.cost:.2f}×" for m in timed if m is not best)
    return best.scheme, f"its passes are the fastest of the unquantised forms ({others or 'the only one'})"


@dataclass(frozen=True)
class InMemoryDrafting:
    """When a drafter in memory may draft in a quantised form rather than its fastest unquantised one.

    Its target is not at hand when the forms are measured, so a quantised form is judged by its passes
    alone: they must be ``min_gain`` times faster than the unquantised form's, enough to cover the few
    drafts its rounding costs, and its next-token argmax must agree with the drafter's own float32 on ``min_top1``
    of positions (random tokens, where a model's favourite is seldom clear), which catches a kernel that computes
    a different model on this machine. The agreements measured: docs/quantization.md, "What `auto` measures" and
    "The drafter for the Qwen pair, judged by its target".
    """

    min_gain: float = 1.2
    min_top1: float = 0.35

    def rejects(self, m: Measurement, unquantized: Measurement) -> str | None:
        if m.error:
            return m.error
        reasons = []
        if m.cost * self.min_gain > unquantized.cost:
            reasons.append(f"{unquantized.cost / m.cost:.2f}× the speed of {unquantized.scheme} < {self.min_gain}×")
        if m.top1 < self.min_top1:
            reasons.append(f"top-1 agreement with its float32 {m.top1:.3f} < {self.min_top1}")
        return ", ".join(reasons) or None


def fastest_drafting_form(
    measurements: Sequence[Measurement], acceptance: InMemoryDrafting = InMemoryDrafting()
) -> tuple[str, str]:
    """``(form name, reason)`` for a drafter in memory: the fastest quantised form ``acceptance`` allows, else the
    fastest unquantised form (:func:`fastest_unquantized`)."""
    name, reason = fastest_unquantized(measurements)
    unquantized = next(m for m in measurements if m.scheme == name)
    best, rejected = _fastest_allowed(measurements, lambda m: acceptance.rejects(m, unquantized), lambda m: 1 / m.cost,
                                      SCHEMES)  # fmt: skip
    if best is None:
        return name, reason + (f"; no quantised form qualifies ({rejected})" if rejected else "")
    reason = (f"its passes take {best.cost / unquantized.cost:.2f}× those of {name}, the fastest unquantised form "
              f"(decode {best.decode_ms:.0f} ms, verify {best.verify_ms:.0f} ms)")  # fmt: skip
    return best.scheme, reason + (f" (not: {rejected})" if rejected else "")


def drafting_candidates() -> list[str]:
    """The forms a drafter in memory is measured in besides bf16: the unquantised candidates and every scheme
    transformers loads (``quantization_config=``) whose library is installed; the screen sets aside those that
    cannot win on this CPU. Not torch.ao's dynamic int8: its one activation scale per pass computes another model
    where activations have outliers (docs/quantization.md, "Measured tables"), and its one-layer screen
    time, far below its real passes', would set aside the forms that can win."""
    return [*unquantized_candidates(), *(name for name, s in SCHEMES.items() if s.available and s.make_config)]


def resolve_drafting_form(drafter: nn.Module, **measure_kwargs: Any) -> QuantizationChoice:
    """The form a drafter in memory drafts fastest in on this machine (:func:`fastest_drafting_form`), measured once
    per architecture, machine and library versions. ``measure_kwargs`` go to :func:`cached_measure`."""
    measurements = cached_measure(drafter, drafting_candidates(), **measure_kwargs)
    name, reason = fastest_drafting_form(measurements)
    return QuantizationChoice(AUTO, FORMS[name], reason, tuple(measurements))


def unquantized_candidates() -> list[str]:
    """fp32, and fp16 where the CPU computes in it (bf16, the baseline, is always measured)."""
    return ["fp32", *(["fp16"] if native_fp16() else [])]


def _model_identity(subject: str | nn.Module) -> str:
    if isinstance(subject, nn.Module):
        return f"{model_config(subject).model_type}-architecture-{config_fingerprint(subject)}"
    name_or_path = subject
    if name_or_path in ZOO and not Path(name_or_path).is_dir():
        return f"{name_or_path}@{zoo_revision(name_or_path)}"
    path = Path(name_or_path)
    if path.is_dir():
        weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.glob("*.safetensors"))
        return f"{path.resolve()}:{hashlib.sha256(repr(weights).encode()).hexdigest()[:12]}"
    return name_or_path


def cache_key(subject: str | nn.Module, schemes: Sequence[str], options: MeasureOptions) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "model": _model_identity(subject),
        "schemes": list(schemes),
        **machine_key(),
        "options": asdict(options),
    }


def cache_path(key: dict[str, Any]) -> Path:
    return record_path(key, Path(key["model"]).name)


def cached_measure(
    subject: str | nn.Module,
    schemes: Sequence[str] | None = None,
    options: MeasureOptions | None = None,
    refresh: bool = False,
    progress: bool = True,
    **measure_kwargs: Any,
) -> list[Measurement]:
    """:func:`measure` of a checkpoint (a zoo name, folder or Hub id) or :func:`measure_in_memory` of a model, read
    from ``$VIASD_HOME/quantization`` when this machine measured it before; a progress bar shows while it measures
    unless ``progress`` is False. It prints nothing else: :func:`markdown_table` shows what was measured."""
    options = options or MeasureOptions()
    names = list(schemes if schemes is not None else SCHEMES)
    key = cache_key(subject, names, options)
    path = cache_path(key)
    record = None if refresh else read_record(path)
    if record is not None:
        try:
            return [Measurement(**m) for m in record["measurements"]]
        except (TypeError, KeyError):
            pass  # unreadable (e.g. edited by hand): measure again and overwrite it
    if isinstance(subject, nn.Module):
        measurements = measure_in_memory(subject, names, options, progress=progress)
    else:
        measurements = measure(subject, names, options, progress=progress, **measure_kwargs)
    write_record(path, {"key": key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "measurements": [asdict(m) for m in measurements]})  # fmt: skip
    return measurements


def resolve_quantization(
    name_or_path: str,
    scheme: str,
    acceptance: Acceptance = Acceptance(),
    draft_for: str | None = None,
    **measure_kwargs: Any,
) -> QuantizationChoice:
    """The scheme ``quantization=scheme`` means for this model; ``auto`` measures (or reads the cache).

    ``draft_for`` names the target this model drafts for: ``auto`` then measures agreement with that
    target and picks the scheme with which the target decodes fastest (:mod:`.drafting`), since a
    drafter's disagreements cost only speed. ``measure_kwargs`` go to :func:`cached_measure`
    (``options``, ``refresh``, ``progress``, ...).
    """
    if scheme != AUTO:
        chosen = get_scheme(scheme)
        chosen.require()
        alias = f"alias {scheme!r}, the best {chosen.bits}-bit scheme measured on CPU: " if scheme in ALIASES else ""
        return QuantizationChoice(scheme, chosen, f"{alias}{chosen.name} ({chosen.summary})")
    available = [name for name, s in SCHEMES.items() if s.available]
    if draft_for is not None:
        options = replace(measure_kwargs.pop("options", None) or MeasureOptions(), judge=draft_for)
        measurements = cached_measure(name_or_path, [*unquantized_candidates(), *available], options, **measure_kwargs)
        name, reason = choose_drafter(measurements)
    else:
        measurements = cached_measure(name_or_path, available, **measure_kwargs)
        name, reason = choose(measurements, acceptance)
    return QuantizationChoice(AUTO, FORMS[name], reason, tuple(measurements))


def resolve_dtype(
    subject: str | nn.Module, candidates: Sequence[str] = ("fp32",), **measure_kwargs: Any
) -> QuantizationChoice:
    """The unquantised form a model runs fastest in on this machine, bf16 or one of ``candidates``, measured once:
    fp32 or bf16 for ``load_pretrained(dtype="auto")`` (fp16's narrow range could change a target's output), any
    of :func:`unquantized_candidates` for a drafter in memory. ``measure_kwargs`` go to :func:`cached_measure`."""
    measurements = cached_measure(subject, list(candidates), **measure_kwargs)
    name, reason = fastest_unquantized(measurements)
    return QuantizationChoice(AUTO, FORMS[name], reason, tuple(measurements))


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _verdict(
    m: Measurement, measurements: Sequence[Measurement], acceptance: Acceptance, drafting: InMemoryDrafting | None
) -> str:
    """What ``auto`` makes of one row: a quantised scheme by ``acceptance`` (by ``drafting`` for a drafter in memory),
    a judged drafter by its target's speed, an unquantised form by its speed alone (:func:`fastest_unquantized`)."""
    baseline = next(b for b in measurements if b.scheme == BASELINE.name)
    if m.scheme == BASELINE.name:
        return "baseline"
    if baseline.judge_bytes is not None:
        why = DraftingAcceptance().rejects(m, baseline)
    elif drafting is not None and m.scheme in SCHEMES:
        unquantized = fastest_unquantized(measurements)[0]
        why = drafting.rejects(m, next(u for u in measurements if u.scheme == unquantized))
    else:
        why = acceptance.rejects(m) if m.scheme in SCHEMES else m.error
    return "yes" if why is None else f"no: {why}"


def markdown_table(
    measurements: Sequence[Measurement], acceptance: Acceptance = Acceptance(), drafting: InMemoryDrafting | None = None
) -> str:
    """Per form: ms per layer, decode and verify pass, ratios to bf16, agreement, and whether ``auto`` may pick it.

    Measurements judged by a target (a drafter's) add how fast the target decodes with each, and are
    ruled on by :class:`.drafting.DraftingAcceptance` instead of ``acceptance``; with ``drafting``, quantised
    forms are ruled on as for a drafter in memory."""
    baseline = next(m for m in measurements if m.scheme == BASELINE.name)
    judged = baseline.judge_bytes is not None
    agreement = "top-1 with target | KL from target | target speed" if judged else "top-1 | KL"
    rows = [f"| form | layer ms | decode ms | × bf16 | verify ms | × bf16 | {agreement} | auto may pick |",
            "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if judged else "") + "---|"]  # fmt: skip
    for m in measurements:
        speed = None if m.error or not judged else drafting_throughput(m) / drafting_throughput(baseline)
        cells = [m.scheme, _cell(m.layer_ms, ".2f"), _cell(m.decode_ms, ".0f"), _cell(m.decode_ratio, ".2f"),
                 _cell(m.verify_ms, ".0f"), _cell(m.verify_ratio, ".2f"), _cell(m.top1, ".3f"), _cell(m.kl, ".4f"),
                 *([_cell(speed, ".2f") + ("×" if speed else "")] if judged else []),
                 _verdict(m, measurements, acceptance, drafting)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
