"""An assistant model drafting in the fastest form measured on this machine, where that cannot change the output.

In lossless greedy decoding every committed token is the target's own choice, so the drafter's precision changes
only how fast drafts come and how many the target keeps. A drafter loaded in float32 on a CPU with native bf16, or
in bf16 on one without, drafts slower than it could; so may an unquantised drafter where a 4-bit kernel runs its
passes faster (docs/quantization.md). Wherever timings may steer (``ViaSDConfig.reproducible``, by default lossless
greedy decoding) VIA-SD drafts with a copy in the form measured fastest here: unquantised (fp32, bf16, or fp16 where
the CPU computes in it) or quantised (the schemes of :mod:`viasd_hf.models.quantization` that transformers loads and
whose library is installed, made from the drafter saved once to a temporary folder), measured by
:func:`viasd_hf.models.quantization.choice.resolve_drafting_form` once per architecture and machine, then read from
the cache. One copy per drafter is kept while the drafter lives, so the conversion is paid once and later calls
reuse it; a drafter whose weights change afterwards keeps its first copy, so pass ``reproducible=True`` for one that
is still being trained. The user's model is never changed. Where timings may not steer (by default tiered mode and
sampling, where the drafter's distribution shapes the output; everywhere with ``reproducible=True``) the model
drafts as given. A quantised copy reads prompts, and any pass over as many tokens as its twin was measured faster
from, through that twin with the same weights dequantised (``drafting_reader``,
:mod:`viasd_hf.models.quantization.reader`), made with the copy. So does a drafter its user quantised (a torchao
model, or a bitsandbytes one before its first pass): it drafts as it is, and its twin, made on its first call,
reads. A 4-bit kernel reading a long prompt is what made such a drafter slower than greedy on Spec-Bench's RAG
prompts (docs/results.md). The twin costs the dequantised weights' memory; ``reproducible=True`` keeps the drafter
alone.

Making the copy and its twin costs seconds (11 s for the 0.5B drafter in int4 on an AMX Xeon, reading its weights
included), which a process that decodes one short answer (4 to 6 s there) never earns back. So the
copy is made the way one rents skis until the rent would have bought them (``making_pays``): a process drafts
with the drafter as given, adding up what each call lost against the copy (``lost_to_drafting_as_given``: its
drafting passes' difference, as measured when the forms were compared, and what its plain blocks would have saved
speculating at the copy's pace), and makes the copy once that sum reaches what making it took the last time on this
machine (``FormNotes``), so it never pays much more than twice the better of the two choices. Where making it was
never timed, the first call makes it.
"""
from __future__ import annotations

import threading
import time

from torch import nn

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.memory import ModelLocal, kept_on
from viasd_hf.control.speculation_switch import SpeculationSwitch
from viasd_hf.control.tier_controller import measures_wall_clock
from viasd_hf.engine.batch.model_drafts import Reader
from viasd_hf.engine.batch.stats import BatchViaSDStats
from viasd_hf.engine.shards import Shards, from_rank_zero, shards_of
from viasd_hf.extras import quietly as _quietly
from viasd_hf.masks.architectures import config_fingerprint, model_config
from viasd_hf.models.machine import machine_key, read_record, record_path, write_record
from viasd_hf.models.quantization import UNQUANTIZED
from viasd_hf.models.quantization.choice import resolve_drafting_form
from viasd_hf.models.quantization.measure import converted
from viasd_hf.models.quantization.reader import dequantized_twin, fewest_tokens_for_twin
from viasd_hf.models.quantization.schemes import FORMS, Scheme

ATTRIBUTE = "viasd_drafting_form"  # where a model keeps what was made of it for drafting (``DraftingForm``)
_LOCK = threading.Lock()
_NOT_YET = object()


class DraftingForm(ModelLocal):
    """What ``fastest_form`` made of one model, kept on that model (``model.viasd_drafting_form``): its drafting
    ``copy`` (``None``: it drafts as it is), and, for a model that drafts, its ``reader``."""

    def __init__(self) -> None:
        self.copy: nn.Module | None | object = _NOT_YET
        self.reader: Reader | None = None
        self.rent = 0.0  # seconds this process's calls lost drafting as given, against the copy (``drafted_as_given``)


class FormNotes:
    """What making a copy of one architecture in one form took on this machine (CPU, threads, library versions), kept
    in ``$VIASD_HOME/quantization`` for later processes: the seconds making the copy and its twin took
    (``making_seconds``), and the fewest tokens from which the twin runs a pass faster (``fewest_tokens``)."""

    def __init__(self, source: nn.Module, form: str) -> None:
        identity = f"{model_config(source).model_type}-architecture-{config_fingerprint(source)}"
        self.key = {"drafting_copy_of": identity, "form": form, **machine_key()}
        self.path = record_path(self.key, f"{identity}-{form}-copy")

    def read(self, name: str) -> float | None:
        notes = (read_record(self.path) or {}).get("notes")
        value = notes.get(name) if isinstance(notes, dict) else None
        return value if isinstance(value, (int, float)) and value > 0 else None

    def write(self, **notes: float) -> None:
        kept = (read_record(self.path) or {}).get("notes")
        write_record(self.path, {"key": self.key, "notes": (kept if isinstance(kept, dict) else {}) | notes})


def _form_of(model: nn.Module) -> DraftingForm:
    return kept_on(model, ATTRIBUTE, DraftingForm)


def drafter_for_call(drafter: nn.Module | None, config: ViaSDConfig, do_sample: bool,
                     shards: Shards | None = None) -> nn.Module | None:
    """The model that drafts for this call: the drafter's fastest form where its precision cannot change the output
    (for a sharded target's ``shards``, the form rank 0 measured)."""
    if drafter is None or not measures_wall_clock(config.reproducible, config.mode == "lossless", do_sample):
        return drafter
    return fastest_form(drafter, shards)


def making_pays(drafter: nn.Module) -> bool:
    """Whether the drafter drafts as its copy from this call on (made now, if not yet): yes where the copy is made,
    where there is nothing to make, where making one was never timed on this machine, and once drafting as given has
    cost this process as much as making the copy took (``drafted_as_given``, ``FormNotes``)."""
    with _LOCK:
        kept = _form_of(drafter)
        if kept.copy is not _NOT_YET:
            return True
        rent = kept.rent
    name = measured_form(drafter)
    if name is None or in_form(drafter, FORMS[name]):
        return True
    price = FormNotes(drafter, name).read("making_seconds")
    return price is None or rent >= price


def drafted_as_given(drafter: nn.Module | None, drafting: nn.Module | None, stats: BatchViaSDStats,
                     switch: SpeculationSwitch | None) -> None:
    """After a call that drafted with ``drafting``: where that was the drafter as given while a copy in a faster form is
    still to be made, what the call lost against the copy (``lost_to_drafting_as_given``, its ``stats`` and the
    speculation ``switch`` it decided with), at the one-token passes of both forms measured when they were compared,
    adds to the rent ``making_pays`` weighs."""
    if drafter is None or drafting is not drafter or drafter.__dict__.get(ATTRIBUTE) is None:
        return
    if not convertible(drafter):
        return
    choice = resolve_drafting_form(drafter, progress=False)
    name = choice.scheme.name
    if in_form(drafter, FORMS[name]):
        return
    passes_ms = {m.scheme: m.decode_ms for m in choice.measurements}
    given = next((form.name for form in UNQUANTIZED.values() if form.dtype == drafter.dtype), None)
    if passes_ms.get(given) and passes_ms.get(name):
        lost = lost_to_drafting_as_given(stats, switch, max(passes_ms[given] - passes_ms[name], 0.0) / 1000)
        with _LOCK:
            _form_of(drafter).rent += lost


def lost_to_drafting_as_given(stats: BatchViaSDStats, switch: SpeculationSwitch | None, cheaper: float) -> float:
    """The seconds a call (its ``stats``) lost by drafting with a drafter whose passes each take
    ``cheaper`` seconds more than its copy's: every drafting pass's difference; and, for the blocks it decoded plainly
    (where the drafter as given was too slow for speculation to pay), what speculating at the copy's pace would have
    saved, that pace being the ``switch``'s speculative blocks with each of their drafting passes ``cheaper``."""
    lost = stats.drafter_forwards * cheaper
    speculative = stats.blocks - stats.plain_blocks
    if switch is None or not speculative or not stats.plain_blocks:
        return lost
    pace, plain_pace, tokens = switch.speculative.mean(), switch.plain.mean(), switch.tokens[True].mean()
    if not (pace and plain_pace and tokens):
        return lost
    copys_block = tokens / pace - stats.drafter_forwards / speculative * cheaper  # a speculative block's seconds
    if copys_block <= 0:
        return lost
    saved_per_token = 1 / plain_pace - copys_block / tokens
    return lost + max(saved_per_token, 0.0) * stats.plain_blocks * stats.batch_size


def convertible(drafter: nn.Module) -> bool:
    """An unquantised model on CPU in a form that is measured (float64 stays: it asks for exactness, not speed), whole
    on this rank (a sharded model's passes are collectives, which rank 0 cannot run alone to measure them)."""
    if getattr(drafter, "hf_quantizer", None) is not None or drafter.device.type != "cpu":
        return False
    if shards_of(drafter) is not None:
        return False
    if any(type(module).__module__.startswith("torch.ao.nn.quantized") for module in drafter.modules()):
        return False  # quantised after loading (torch.ao's dynamic int8)
    return drafter.dtype in {form.dtype for form in UNQUANTIZED.values()}


def fastest_form(drafter: nn.Module, shards: Shards | None = None, now: bool = False) -> nn.Module:
    """The drafter's copy in its fastest form on this machine, made once making it pays (``making_pays``; ``now``:
    at once, as a bench comparing steady states wants it); the drafter itself until then, and where it is in that form
    already or cannot be converted. Calls wait for one another, so one copy is made. Drafting for a target sharded over
    ``shards``, every rank drafts in the form, reads from the length, and makes the copy when, rank 0 measured: the
    ranks' drafts must be the same (``engine.shards``)."""
    with _quietly():
        if not now and not from_rank_zero(shards, lambda: making_pays(drafter)):
            return drafter
    with _LOCK, _quietly():
        kept = _form_of(drafter)
        if kept.copy is _NOT_YET:
            name = from_rank_zero(shards, lambda: measured_form(drafter))
            form = FORMS[name] if name is not None else None
            started = time.perf_counter()
            made = None if form is None or in_form(drafter, form) else converted(drafter, form)
            drafting = drafter if made is None else made  # a drafter quantised by its user drafts as it is
            twin = dequantized_twin(drafting, drafter if made is not None else None)  # before bitsandbytes packs
            if made is not None:
                FormNotes(drafter, form.name).write(making_seconds=time.perf_counter() - started)
            if twin is not None:
                fewest = from_rank_zero(shards, lambda: _twin_reads_from(drafter, made, form, twin))
                _form_of(drafting).reader = Reader(twin, fewest)
            kept.copy = made
        copy = kept.copy
    return drafter if copy is None else copy


def _twin_reads_from(drafter: nn.Module, copy: nn.Module | None, form: Scheme | None, twin: nn.Module) -> int:
    """The fewest tokens from which ``twin`` runs a pass faster than the model it is the twin of: the drafter as its
    user quantised it (timed now), or its ``copy`` in ``form`` (timed once per architecture, form and machine)."""
    if copy is None:
        return fewest_tokens_for_twin(drafter, twin)
    notes = FormNotes(drafter, form.name)
    fewest = notes.read("fewest_tokens")
    if fewest is None:
        fewest = fewest_tokens_for_twin(copy, twin)
        notes.write(fewest_tokens=fewest)
    return int(fewest)


def measured_form(drafter: nn.Module) -> str | None:
    """The name of the form ``drafter`` drafts fastest in on this machine; ``None`` where it is not converted."""
    return resolve_drafting_form(drafter, progress=False).scheme.name if convertible(drafter) else None


def in_form(drafter: nn.Module, form: Scheme) -> bool:
    """Whether an unquantised drafter is in ``form`` already."""
    return form.name in UNQUANTIZED and form.dtype == drafter.dtype


def drafting_reader(model: nn.Module) -> Reader | None:
    """The twin through which a quantised drafting copy made here runs its long passes (the same weights,
    dequantised) and the fewest tokens it runs faster, as measured when it was made (``fewest_tokens_for_twin``);
    None for any other model."""
    with _LOCK:
        form = model.__dict__.get(ATTRIBUTE)
        return form.reader if form is not None else None


def prompt_reader(model: nn.Module) -> nn.Module | None:
    """The twin of :func:`drafting_reader`, or None."""
    reader = drafting_reader(model)
    return reader.twin if reader is not None else None


def drafting_copy(drafter: nn.Module) -> nn.Module | None:
    """The copy :func:`fastest_form` made of ``drafter``; None where it made none (not called yet, or the drafter
    drafts as it is)."""
    with _LOCK:
        form = drafter.__dict__.get(ATTRIBUTE)
        return None if form is None or form.copy is _NOT_YET else form.copy
