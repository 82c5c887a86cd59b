"""The form a model runs in, chosen by measuring this machine: the quick measurement, its cache, ``dtype="auto"``
and the drafter's machine-chosen copy in lossless greedy decoding (``ViaSDConfig.drafter_precision``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from torch import nn
from tqdm import tqdm
from transformers import LlamaConfig, PreTrainedTokenizerFast

from conftest import VOCAB, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd, generation
from viasd_hf.cli import main
from viasd_hf.drafters import precision as drafter_precision
from viasd_hf.models.loading import load_pretrained
from viasd_hf.models.quantization import (
    BASELINE,
    SCHEMES,
    Measurement,
    MeasureOptions,
    cached_measure,
    fastest_drafting_form,
    fastest_unquantized,
    markdown_table,
    resolve_dtype,
)
from viasd_hf.models.quantization import choice as quantization_choice
from viasd_hf.models.quantization.measure import converted, time_in_rounds
from viasd_hf.models.quantization.probe import ruled_out_by_screen
from viasd_hf.models.quantization.reader import dequantized_twin, fewest_tokens_for_twin

quantization_measure = importlib.import_module("viasd_hf.models.quantization.measure")  # the package's `measure` is a function
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
# every block speculates, whatever this machine's timings: the drafting form is what these tests look at
pytestmark = pytest.mark.usefixtures("speculating")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    return tmp_path


def timed(form: str, ratio: float) -> Measurement:
    return Measurement(form, decode_ms=10 * ratio, verify_ms=20 * ratio, decode_ratio=ratio, verify_ratio=ratio,
                       top1=1.0, kl=0.0)  # fmt: skip


@pytest.fixture
def measured(home, monkeypatch):
    """Measuring in memory, faked: ``verdict[0]`` is the form that comes out fastest; ``calls`` counts measurements."""
    calls, verdict = [], ["bf16"]

    def measure_in_memory(model, names, options, progress):
        calls.append(list(names))
        return [timed(BASELINE.name, 1.0), *(timed(name, 0.5 if name == verdict[0] else 2.0) for name in names)]

    monkeypatch.setattr(quantization_choice, "measure_in_memory", measure_in_memory)
    return calls, verdict


# --------------------------------------------------------------------------- measuring, quickly


class Stub:
    """Stands in for a timed model whose passes take ``ms`` each."""

    def __init__(self, ms: float) -> None:
        self.ms, self.rounds = ms, 0

    def timed_round(self) -> None:
        self.rounds += 1

    def pass_ms(self) -> float:
        return self.ms


def test_a_form_clearly_slower_than_the_fastest_stops_after_the_minimum_rounds():
    stubs = {"bf16": Stub(10.0), "fp32": Stub(14.0), "bnb-8bit": Stub(40.0)}  # an unquantised form runs every round
    with tqdm(disable=True) as bar:
        stopped = time_in_rounds(stubs, MeasureOptions(repeats=5, min_rounds=2, losing=1.3), bar)
    assert list(stopped) == ["bnb-8bit"] and stopped["bnb-8bit"].startswith("stopped after 2 rounds: 4.00×")
    assert [stub.rounds for stub in stubs.values()] == [5, 5, 2]


def test_the_screen_rules_out_forms_far_slower_than_the_fastest_but_never_an_unquantised_one():
    layer = {"bf16": 3.0, "fp32": 6.0, "bnb-4bit": 2.5, "bnb-8bit": 9.0, "torchao-int8": "ImportError: no torchao",
             "torchao-int4-weight-only": 1.0}
    assert ruled_out_by_screen(layer, margin=2.0) == {
        "bnb-4bit": "ruled out: its layer pass takes 2.5× the fastest form's",
        "bnb-8bit": "ruled out: its layer pass takes 9.0× the fastest form's",
        "torchao-int8": "ImportError: no torchao",
    }


def test_a_tiny_model_in_memory_is_measured_in_its_unquantised_forms_and_left_as_it_was(home):
    model = tiny_causal_lm("llama")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    options = MeasureOptions(prompts=2, prompt_tokens=16, context=16, repeats=2, threads=1)
    measurements = cached_measure(model, ["fp32"], options, progress=False)
    assert [m.scheme for m in measurements] == ["bf16", "fp32"]
    for m in measurements:
        assert m.layer_ms > 0 and m.decode_ms > 0 and m.verify_ms > 0
        assert m.error is None or m.error.startswith(("ruled out", "stopped after")), m.error
    assert measurements[0].decode_ratio == 1.0 and measurements[0].top1 > 0.8  # bf16 against float32
    assert model.dtype == torch.float32 and all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert "| fp32 | " in markdown_table(measurements)


@pytest.mark.parametrize("quantised", [False, True])
def test_agreement_only_shown_is_measured_on_one_prompt_and_the_float32_form_is_the_reference(home, monkeypatch,
                                                                                               quantised):
    """Unquantised forms of a model measured for itself are chosen by speed alone: their agreement is measured on the
    first prompt, the float32 form's not at all (it is the reference); a quantised form, judged by its agreement, is
    measured on every prompt, and so is the reference, while the unquantised forms keep to the first."""
    read = []
    log_probs = quantization_measure._log_probs
    monkeypatch.setattr(quantization_measure, "_log_probs", lambda model, windows: read.append(len(windows)) or
                        log_probs(model, windows))  # fmt: skip
    options = MeasureOptions(prompts=3, prompt_tokens=16, context=16, repeats=2, threads=1, screen_margin=1e9,
                             losing=1e9)  # fmt: skip
    names = ["fp32", "torchao-int8-weight-only"] if quantised else ["fp32"]
    measurements = cached_measure(tiny_causal_lm("llama"), names, options, progress=False)
    fp32 = next(m for m in measurements if m.scheme == "fp32")
    assert fp32.top1 == 1.0 and fp32.kl == 0.0
    assert all(m.top1 is not None for m in measurements)
    assert read == ([3, 1, 3] if quantised else [1, 1]), "the reference, then bf16 (and the quantised form)"


def test_a_timed_cache_is_cast_from_the_float32_forms_not_recomputed():
    """bf16 where it is emulated takes half a minute to prefill a 1.5B model's context: the bf16 form's cache of the
    context is the float32 form's, cast, and the bf16 model runs only the timed passes."""
    fp32 = tiny_causal_lm("llama")
    bf16 = quantization_measure.converted(fp32, quantization_measure.FORMS["bf16"])
    ids = torch.randint(2, VOCAB, (1, 22), generator=torch.Generator().manual_seed(0))
    context, block = ids[:, :16], ids[:, 16:]
    widths = []
    bf16.register_forward_pre_hook(lambda _, args, kwargs: widths.append((args[0] if args else kwargs["input_ids"])
                                                                         .shape[1]), with_kwargs=True)  # fmt: skip
    seed = quantization_measure._Timed(fp32, context, block).cache
    timed = quantization_measure._Timed(bf16, context, block, seed=seed)
    assert timed.cache.get_seq_length() == 16 and timed.cache.layers[0].keys.dtype == torch.bfloat16
    assert torch.equal(timed.cache.layers[0].keys, seed.layers[0].keys.to(torch.bfloat16))
    timed.timed_round()
    assert widths == [1, 6, 1, 6], "warm-up and one round; never the context"
    assert timed.cache.get_seq_length() == 16


def test_the_fastest_unquantised_form_is_chosen_and_bf16_wins_a_tie():
    assert fastest_unquantized([timed("bf16", 1.0), timed("fp32", 0.8)])[0] == "fp32"
    assert fastest_unquantized([timed("bf16", 1.0), timed("fp32", 1.0)])[0] == "bf16"
    stopped = Measurement("fp32", error="ruled out: its layer pass takes 3.0× the fastest form's")
    assert fastest_unquantized([timed("bf16", 1.0), stopped]) == ("bf16", "its passes are the fastest of the "
                                                                          "unquantised forms (the only one)")


# --------------------------------------------------------------------------- the verdict's cache


def test_a_cached_verdict_is_reused_for_every_model_of_the_architecture(measured):
    calls, _ = measured
    first = resolve_dtype(tiny_causal_lm("llama", seed=0))
    again = resolve_dtype(tiny_causal_lm("llama", seed=1))  # other weights, the same shapes: the same speed
    assert len(calls) == 1 and first == again and first.scheme.name == "bf16"
    resolve_dtype(tiny_causal_lm("qwen2"))
    assert len(calls) == 2


def test_a_corrupt_cache_entry_is_measured_again(measured, home):
    calls, _ = measured
    model = tiny_causal_lm("llama")
    resolve_dtype(model)
    (record,) = (home / "quantization").glob("*.json")
    for corrupt in ("{not json", '{"measurements": [{"no_such_field": 1}]}'):
        record.write_text(corrupt)
        assert resolve_dtype(model).scheme.name == "bf16"
        assert json.loads(record.read_text())["measurements"][0]["scheme"] == "bf16"
    assert len(calls) == 3


def test_load_pretrained_dtype_auto_loads_the_measured_form(home, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_causal_lm("llama").save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(folder)
    fastest = ["fp32"]
    monkeypatch.setattr(quantization_choice, "measure", lambda name, names, options, **kwargs: [
        timed("bf16", 1.0), *(timed(n, 0.5 if n == fastest[0] else 2.0) for n in names)])  # fmt: skip
    assert load_pretrained(str(folder), dtype="auto")[0].dtype == torch.float32
    fastest[0] = "bf16"
    assert resolve_dtype(str(folder)).scheme.name == "fp32", "cached: not measured again"
    assert load_pretrained(str(folder), dtype="auto")[0].dtype == torch.float32


# --------------------------------------------------------------------------- the drafter's fastest form


def drafting_models(monkeypatch) -> list:
    """The assistant model each VIA-SD call drafts with."""
    seen = []
    build = generation.batch_drafter

    def spy(assistant_model, *args, **kwargs):
        seen.append(assistant_model)
        return build(assistant_model, *args, **kwargs)

    monkeypatch.setattr(generation, "batch_drafter", spy)
    return seen


def pair(architecture: str = "llama"):
    target = enable_viasd(tiny_causal_lm(architecture, seed=0))
    return target, near_copy(target, scale=0.01)


def lossless(target, **settings) -> ViaSDConfig:
    return ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless",
                       **settings)


def prompt() -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.machine_precision
def test_lossless_greedy_drafts_with_one_converted_copy_and_equals_generate(measured, monkeypatch, speculating):
    calls, _ = measured
    target, drafter = pair()
    seen = drafting_models(monkeypatch)
    expected = target.generate(prompt(), max_new_tokens=16, **GREEDY)
    for _ in range(2):
        out = target.generate(prompt(), assistant_model=drafter, viasd_config=lossless(target), max_new_tokens=16,
                              return_dict_in_generate=True, **GREEDY)  # fmt: skip
        assert torch.equal(out.sequences, expected) and out.viasd_stats.accepted_tokens > 0
    copy, again = seen
    assert copy is again is not drafter and copy.dtype == torch.bfloat16, "one copy, made once and reused"
    assert drafter.dtype == torch.float32 and len(calls) == 1


@pytest.mark.machine_precision
def test_opting_out_or_tiered_or_sampling_drafts_with_the_users_model(measured, monkeypatch):
    calls, _ = measured
    target, drafter = pair()
    seen = drafting_models(monkeypatch)
    for config, sample in ((lossless(target, reproducible=True), False), (lossless(target), True),
                           (ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="tiered"), False)):  # fmt: skip
        target.generate(prompt(), assistant_model=drafter, viasd_config=config, max_new_tokens=4,
                        do_sample=sample, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert all(model is drafter for model in seen) and drafter.dtype == torch.float32 and not calls


@pytest.mark.machine_precision
def test_a_drafter_already_in_its_fastest_form_or_in_float64_drafts_as_it_is(measured, monkeypatch):
    calls, verdict = measured
    verdict[0] = "fp32"
    target, drafter = pair()
    assert drafter_precision.fastest_form(drafter) is drafter and len(calls) == 1
    exact = tiny_causal_lm("llama", dtype=torch.float64)
    assert drafter_precision.fastest_form(exact) is exact and len(calls) == 1, "float64 is not measured"


def test_a_drafter_drafts_in_a_quantised_form_only_where_it_is_clearly_faster_and_computes_the_same_model():
    def quantised(ratio: float, top1: float = 0.9, error: str | None = None) -> Measurement:
        return Measurement("bnb-4bit", decode_ms=10 * ratio, verify_ms=20 * ratio, decode_ratio=ratio,
                           verify_ratio=ratio, top1=top1, kl=0.1, error=error)  # fmt: skip

    unquantised = [timed("bf16", 1.0), timed("fp32", 1.6)]
    name, reason = fastest_drafting_form([*unquantised, quantised(0.6)])
    assert name == "bnb-4bit" and reason.startswith("its passes take 0.60× those of bf16")
    for slower_or_wrong in (quantised(0.9), quantised(0.6, top1=0.2), quantised(0.6, error="failed: no kernel")):
        name, reason = fastest_drafting_form([*unquantised, slower_or_wrong])
        assert name == "bf16" and "no quantised form qualifies" in reason
    assert fastest_drafting_form([timed("bf16", 1.0), timed("fp32", 0.5), quantised(0.45)])[0] == "fp32", (
        "measured against the fastest unquantised form, not bf16")


@pytest.mark.machine_precision
def test_a_drafter_measured_fastest_quantised_drafts_as_a_quantised_copy_with_generates_output(measured, monkeypatch):
    calls, verdict = measured
    verdict[0] = "torchao-int8-weight-only"  # runs on every CPU
    target, drafter = pair()
    before = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    seen = drafting_models(monkeypatch)
    expected = target.generate(prompt(), max_new_tokens=16, **GREEDY)
    out = target.generate(prompt(), assistant_model=drafter, viasd_config=lossless(target), max_new_tokens=16,
                          return_dict_in_generate=True, **GREEDY)  # fmt: skip
    assert torch.equal(out.sequences, expected) and out.viasd_stats.accepted_tokens > 0
    (copy,) = seen
    assert copy is not drafter and copy.hf_quantizer is not None, "drafted with a quantised copy, loaded from a save"
    assert drafter_precision.drafting_copy(drafter) is copy, "the copy is known, for reports"
    assert copy.config._name_or_path == drafter.config._name_or_path == copy.name_or_path, "under the drafter's name, by which its pair's masks are found"
    assert "torchao-int8-weight-only" in calls[0], "quantised schemes are measured for a drafter in memory"
    assert "torch-dynamic-int8" not in calls[0], "not torch.ao's dynamic int8, which computes another model"
    assert all(torch.equal(before[n], t) for n, t in drafter.state_dict().items()), "the user's drafter is untouched"


@pytest.mark.machine_precision
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_a_copy_is_made_once_drafting_as_given_has_cost_what_making_it_took_here(architecture, measured, monkeypatch):
    """Ski rental: where making the copy was timed on this machine (an earlier process), calls draft with the drafter
    as given, each drafting pass adding what it cost beyond the copy's (fp32 20 ms against 5 ms, as measured), until
    that reaches what making the copy took (0.1 s); from then on the copy drafts. The output is greedy's throughout."""
    calls, verdict = measured
    verdict[0] = "torchao-int8-weight-only"  # runs on every CPU
    target, drafter = pair(architecture)
    drafter_precision.FormNotes(drafter, verdict[0]).write(making_seconds=0.1)
    seen = drafting_models(monkeypatch)
    expected = target.generate(prompt(), max_new_tokens=16, **GREEDY)
    passes = []
    while len(passes) < 12 and (not seen or seen[-1] is drafter):
        out = target.generate(prompt(), assistant_model=drafter, viasd_config=lossless(target), max_new_tokens=16,
                              return_dict_in_generate=True, **GREEDY)  # fmt: skip
        assert torch.equal(out.sequences, expected)
        passes.append(out.viasd_stats.drafter_forwards)
    given = [model is drafter for model in seen]
    assert given[0] and not given[-1] and given == sorted(given, reverse=True), "as given first, then the copy"
    rent = 0.015 * sum(passes[: given.count(True)])
    assert rent >= 0.1 > rent - 0.015 * passes[given.count(True) - 1], "made once the rent reached the price"
    assert seen[-1] is drafter_precision.drafting_copy(drafter)


@pytest.mark.parametrize("plain_seconds, lost", [(0.2, 2.5), (0.1, 1.5)])
def test_a_call_drafting_as_given_loses_its_passes_difference_and_where_the_copy_would_speculate_its_plain_blocks(
        plain_seconds, lost):
    """10 drafting passes 0.15 s dearer than the copy's: 1.5 s. The call decoded 15 blocks plainly, its 5 speculative
    ones committing 3 tokens in 0.7 s with 2 passes each (slower than plain blocks of 1 token in 0.2 s); with the copy
    they would take 0.4 s, faster than plain, so each plain token lost 0.2 - 0.4 / 3 s: 1 s more. Against plain blocks
    of 0.1 s the copy's pace would not have won: the passes alone."""
    from types import SimpleNamespace

    from viasd_hf.control.speculation_switch import SpeculationSwitch

    switch = SpeculationSwitch()
    for speculated, tokens, seconds in [(True, 3, 0.7), (False, 1, plain_seconds)] * 4:
        switch.observe(speculated, tokens, seconds)
    stats = SimpleNamespace(drafter_forwards=10, blocks=20, plain_blocks=15, batch_size=1)
    assert drafter_precision.lost_to_drafting_as_given(stats, switch, 0.15) == pytest.approx(lost)
    assert drafter_precision.lost_to_drafting_as_given(stats, None, 0.15) == pytest.approx(1.5)


@pytest.mark.machine_precision
@pytest.mark.parametrize("scheme", ["bnb-4bit", "torchao-int4-weight-only"])
def test_a_quantised_drafting_copy_reads_long_prompts_through_its_dequantised_twin(scheme, measured, monkeypatch):
    """The twin computes the quantised model with plain linear layers and shares everything else; a lossless call
    whose copy is quantised reads its prompt through the twin (one pass over it) and drafts with the copy."""
    if not SCHEMES[scheme].available:
        pytest.skip(f"{SCHEMES[scheme].requirement} is not installed")
    calls, verdict = measured
    verdict[0] = scheme
    # the 4-bit CPU kernels need layers at least a quantisation group (64 for bitsandbytes, 128 for torchao) wide
    target = enable_viasd(tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256))
    drafter = near_copy(target, scale=0.01)
    monkeypatch.setattr(drafter_precision, "fewest_tokens_for_twin", lambda model, twin: 32)  # measured: this CPU's
    copy = drafter_precision.fastest_form(drafter)
    twin = drafter_precision.prompt_reader(copy)
    assert drafter_precision.drafting_reader(copy).from_tokens == 32
    assert copy.hf_quantizer is not None
    assert twin is not None and twin is not copy
    quantised = [name for name, module in copy.named_modules() if type(module).__name__ == "Linear4bit"
                 or type(getattr(module, "weight", None)).__module__.startswith("torchao")]  # fmt: skip
    plain = dict(twin.named_modules())
    assert quantised and all(type(plain[name]) is nn.Linear and type(plain[name].weight) is nn.Parameter
                             for name in quantised), "every quantised layer is a plain one in the twin"  # fmt: skip
    assert twin.get_input_embeddings() is copy.get_input_embeddings(), "everything but the 4-bit layers is shared"
    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        same = (twin(ids).logits.argmax(-1) == copy(ids).logits.argmax(-1)).float().mean()
    assert same >= 0.9, "the twin computes the 4-bit model (up to the rounding of its products)"
    long_passes = []
    twin.model.register_forward_pre_hook(  # the copy's body shares its hooks: count the twin's own passes
        lambda body, args, kwargs: long_passes.append(kwargs["input_ids"].shape[1]) if body is twin.model else None,
        with_kwargs=True)
    long_prompt = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    expected = target.generate(long_prompt, max_new_tokens=12, **GREEDY)
    out = target.generate(long_prompt, assistant_model=drafter, viasd_config=lossless(target), max_new_tokens=12,
                          return_dict_in_generate=True, **GREEDY)  # fmt: skip
    assert torch.equal(out.sequences, expected) and out.viasd_stats.drafter_forwards > 1
    assert len(long_passes) == 1 and long_passes[0] >= 40, "the twin read the prompt, once; the copy drafted"


@pytest.mark.machine_precision
def test_where_a_copys_twin_starts_to_pay_is_timed_once_per_architecture_form_and_machine(measured, monkeypatch):
    """Timing the twin against the copy costs a first call seconds: a later copy of the same architecture in the same
    form on this machine (as in a new process) reads the length from the cache; another architecture is timed."""
    scheme = SCHEMES["torchao-int4-weight-only"]
    if not scheme.available:
        pytest.skip(f"{scheme.requirement} is not installed")
    measured[1][0] = scheme.name
    monkeypatch.setattr(drafter_precision, "making_pays", lambda drafter: True)  # each drafter makes its copy now
    timed_copies = []
    monkeypatch.setattr(drafter_precision, "fewest_tokens_for_twin", lambda model, twin: timed_copies.append(model) or 16)
    target = tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256)
    first = drafter_precision.fastest_form(near_copy(target, scale=0.01))
    later = drafter_precision.fastest_form(near_copy(target, scale=0.02, seed=2))
    assert timed_copies == [first], "timed once, on the copy"
    assert drafter_precision.drafting_reader(later).from_tokens == 16, "the later copy reads from the length timed"
    other = tiny_causal_lm("qwen2", seed=0, hidden_size=128, intermediate_size=256)
    assert drafter_precision.fastest_form(other) is timed_copies[-1] and len(timed_copies) == 2


@pytest.mark.machine_precision
@pytest.mark.parametrize("reproducible", [None, True])
def test_a_drafter_its_user_quantised_drafts_as_it_is_and_reads_through_its_twin(reproducible, home, monkeypatch):
    """A drafter handed over in a 4-bit form is not converted; by default a dequantised twin of it, made on its first
    call, reads the prompt (a 4-bit kernel reads long prompts slowly), and ``reproducible=True`` keeps it alone."""
    scheme = SCHEMES["torchao-int4-weight-only"]
    if not scheme.available:
        pytest.skip(f"{scheme.requirement} is not installed")
    target = enable_viasd(tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256))
    drafter = converted(near_copy(target, scale=0.01), scheme)  # as the user loaded it
    monkeypatch.setattr(drafter_precision, "fewest_tokens_for_twin", lambda model, twin: 32)  # measured: this CPU's
    seen = drafting_models(monkeypatch)
    passes = {"drafter": [], "twin": []}
    drafter.model.register_forward_pre_hook(
        lambda body, args, kwargs: passes["drafter" if body is drafter.model else "twin"].append(
            kwargs["input_ids"].shape[1]), with_kwargs=True)  # the twin's body shares the drafter's hooks
    long_prompt = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    expected = target.generate(long_prompt, max_new_tokens=12, **GREEDY)
    out = target.generate(long_prompt, assistant_model=drafter, max_new_tokens=12, return_dict_in_generate=True,
                          viasd_config=lossless(target, reproducible=reproducible), **GREEDY)
    assert torch.equal(out.sequences, expected) and seen == [drafter], "it drafted as it is"
    if reproducible:
        assert passes["twin"] == [] and passes["drafter"][0] == 40 and drafter_precision.drafting_reader(drafter) is None
    else:
        assert len(passes["twin"]) == 1 and passes["twin"][0] >= 40, "its twin read the prompt, once"
        assert drafter_precision.drafting_reader(drafter).from_tokens == 32
        assert passes["drafter"] and max(passes["drafter"]) < 32, "the drafter drafted"


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_the_twin_of_a_copy_made_here_takes_its_weights_from_the_source_as_the_kernel_computes_them(architecture):
    """A torchao int4 copy VIA-SD made: its twin's weights come from the unquantised model, quantised as torchao did
    (not from the kernel's product with the identity, which costs a pass over as many tokens as a layer has inputs), and
    they are the weights the kernel computes; a source the copy was not made from is caught, and the kernel used."""
    scheme = SCHEMES["torchao-int4-weight-only"]
    if not scheme.available:
        pytest.skip(f"{scheme.requirement} is not installed")
    source = tiny_causal_lm(architecture, seed=0, hidden_size=128, intermediate_size=256, dtype=torch.bfloat16)
    copy = converted(source, scheme)
    by_kernel = dict(dequantized_twin(copy).named_modules())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "eye", lambda *a, **k: pytest.fail("the kernel computed a weight the source gives"))
        from_source = dict(dequantized_twin(copy, source).named_modules())
    layers = [name for name, module in copy.named_modules() if type(getattr(module, "weight", None)).__name__ == "Int4OpaqueTensor"]
    assert layers, "the copy has int4 layers"
    for name in layers:
        ours, kernels = from_source[name].weight, by_kernel[name].weight
        assert ours.dtype == kernels.dtype and torch.allclose(ours.float(), kernels.float(), rtol=1e-2, atol=1e-3), name
    other = tiny_causal_lm(architecture, seed=1, hidden_size=128, intermediate_size=256, dtype=torch.bfloat16)
    strangers = dict(dequantized_twin(copy, other).named_modules())
    assert all(torch.allclose(strangers[name].weight.float(), by_kernel[name].weight.float(), rtol=1e-2, atol=1e-3)
               for name in layers), "weights the kernel does not compute are not taken"


class _Timed(nn.Module):
    """A model whose pass over n tokens advances ``clock`` by ``fixed + per_token * n`` seconds."""

    def __init__(self, clock: list[float], fixed: float, per_token: float) -> None:
        super().__init__()
        self.clock, self.fixed, self.per_token = clock, fixed, per_token
        self.config = LlamaConfig(vocab_size=VOCAB)
        self.anchor = nn.Parameter(torch.zeros(1))

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def forward(self, ids: torch.Tensor) -> None:
        self.clock[0] += self.fixed + self.per_token * ids.numel()


@pytest.mark.parametrize("twin_costs, expected", [((5.0, 0.25), 8), ((0.5, 1.0), 2), ((5.0, 1.5), 128)])
def test_the_twin_runs_the_passes_from_the_fewest_tokens_it_was_timed_faster(twin_costs, expected):
    """A 4-bit model's pass costs 1 + n (a kernel that unpacks per token); its twin 5 + n/4 is faster from 8 tokens on
    (sizes 2, 4, 8, ...), one faster everywhere from the fewest size, one never faster only for twice the largest."""
    clock = [0.0]
    quantised, twin = _Timed(clock, 1.0, 1.0), _Timed(clock, *twin_costs)
    assert fewest_tokens_for_twin(quantised, twin, clock=lambda: clock[0]) == expected


def test_a_tiny_model_in_memory_is_measured_in_a_quantised_form_from_one_saved_copy(home):
    model = tiny_causal_lm("llama")
    # never set aside, whatever this CPU's kernels: every round is timed and agreement measured
    options = MeasureOptions(prompts=2, prompt_tokens=16, context=16, repeats=2, threads=1, screen_margin=1e9,
                             losing=1e9)  # fmt: skip
    measurements = cached_measure(model, ["torchao-int8-weight-only"], options, progress=False)
    quantised = measurements[1]
    assert quantised.scheme == "torchao-int8-weight-only" and quantised.error is None
    assert quantised.decode_ms > 0 and quantised.verify_ms > 0
    assert quantised.top1 > 0.5, "the copy loaded from the saved model computes the same model"
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None, "the model is left as it was"


# --------------------------------------------------------------------------- the table


def test_profile_prints_the_table_the_precision_choice_measured(measured, capsys, monkeypatch):
    monkeypatch.setattr(quantization_choice, "measure", lambda name, names, options, **kwargs: [
        timed("bf16", 1.0), *(timed(n, 0.7) for n in names)])  # fmt: skip
    assert main(["profile", "--target", "smollm2-135m-instruct", "--precision"]) == 0
    out = capsys.readouterr().out
    assert "| form | layer ms |" in out and "| fp32 | " in out and "auto → fp32: its passes are the fastest" in out
    assert main(["profile", "--target", "smollm2-135m-instruct", "--draft-for", "qwen2.5-coder-1.5b-instruct"]) == 2
