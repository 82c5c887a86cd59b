"""Quantised tiers: scheme names, ``auto`` and its cache, VIA-SD on quantised targets.

Tiny random models; one real checkpoint (SmolLM2-135M) under ``-m integration``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from conftest import VOCAB, TokensPerCall, assert_stats_consistent, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd, routed
from viasd_hf.models import machine, quantization
from viasd_hf.models.loading import load_pretrained
from viasd_hf.models.quantization import (
    ALIASES,
    AUTO,
    BASELINE,
    SCHEMES,
    Acceptance,
    Measurement,
    MeasureOptions,
    QuantizationError,
    QuantizationUnavailableError,
    choose,
    get_scheme,
    invariance,
    resolve_quantization,
)
from viasd_hf.models.quantization import choice as quantization_choice
from viasd_hf.models.quantization.invariance import Invariance, batch_invariant

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # LLM.int8() logs a cast on every call

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
# every dimension a multiple of 128 (torchao's int4 group size, whole bitsandbytes blocks); weights 10× the
# usual scale, so logits are far apart (no near-ties) and activations reach LLM.int8()'s outlier threshold
DIMS = dict(hidden_size=128, intermediate_size=256, initializer_range=0.2)
AVAILABLE = [name for name, scheme in SCHEMES.items() if scheme.available]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny llama with a word-level tokenizer, saved like a real checkpoint."""
    path = tmp_path_factory.mktemp("tiny-quantizable")
    tiny_causal_lm("llama", **DIMS).save_pretrained(path)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    return tmp_path


def windows() -> list[torch.Tensor]:
    return [torch.randint(2, VOCAB, (1, 20), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def fake(scheme: str, ratio: float, top1: float = 0.99, kl: float = 0.01, invariant: bool = True) -> Measurement:
    return Measurement(scheme, decode_ms=100 * ratio, verify_ms=200 * ratio, decode_ratio=ratio, verify_ratio=ratio,
                       top1=top1, kl=kl, batch_invariant=invariant)  # fmt: skip


# --------------------------------------------------------------------------- names and errors


def test_aliases_name_schemes_and_unknown_names_list_the_valid_ones():
    for alias, name in ALIASES.items():
        assert get_scheme(alias) is SCHEMES[name]
        assert SCHEMES[name].bits == {"int8": 8, "4bit": 4}[alias]
    with pytest.raises(QuantizationError, match="valid names: .*bnb-4bit.*int8.*auto"):
        get_scheme("int3")
    with pytest.raises(QuantizationError, match="unknown quantization scheme 'int3'"):
        load_pretrained("unused", quantization="int3")


def test_a_missing_library_names_the_extra_that_installs_it(monkeypatch):
    missing = dataclasses.replace(SCHEMES["torchao-int8"], library="viasd_no_such_module")
    monkeypatch.setitem(SCHEMES, "torchao-int8", missing)
    with pytest.raises(QuantizationUnavailableError, match=r"viasd_no_such_module: pip install 'viasd_hf\[quant\]'"):
        load_pretrained("unused", quantization="torchao-int8")


def test_quantization_and_quantization_config_are_exclusive(tiny_folder):
    with pytest.raises(QuantizationError, match="not both"):
        load_pretrained(str(tiny_folder), quantization="bnb-4bit", quantization_config=object())


# --------------------------------------------------------------------------- the auto choice


def test_auto_never_picks_a_scheme_that_disagrees_even_if_fastest():
    measurements = [fake("bf16", 1.0), fake("bnb-4bit", 0.3, top1=0.5), fake("torchao-int8", 0.4, kl=0.9),
                    fake("bnb-8bit", 0.2, invariant=False), fake("torchao-int8-weight-only", 0.7)]  # fmt: skip
    name, reason = choose(measurements)
    assert name == "torchao-int8-weight-only"
    assert "bnb-4bit: top-1 agreement 0.500 < 0.9" in reason and "torchao-int8: KL 0.900 > 0.1" in reason
    assert "bnb-8bit: not batch-invariant" in reason
    assert choose(measurements, Acceptance(min_top1=0.4, max_kl=1.0))[0] == "bnb-4bit"
    assert choose(measurements, Acceptance(require_batch_invariant=False))[0] == "bnb-8bit"


def test_auto_keeps_bf16_unless_a_scheme_is_clearly_faster_and_skips_failures():
    measurements = [fake("bf16", 1.0), fake("torchao-int8-weight-only", 0.95),
                    Measurement("torchao-int8", error="ImportError: no torchao")]  # fmt: skip
    assert choose(measurements) == ("bf16", "no quantised scheme qualifies (torchao-int8-weight-only: 1.05× the speed "
                                            "of bf16 < 1.1×; torchao-int8: ImportError: no torchao)")
    assert choose(measurements, Acceptance(min_speedup=1.0))[0] == "torchao-int8-weight-only"


def test_auto_measures_once_then_reads_the_cache(home, tiny_folder, monkeypatch):
    calls = []

    def measure(name_or_path, schemes, options, **kwargs):
        calls.append(list(schemes))
        return [fake("bf16", 1.0), *(fake(s, 0.1 * (i + 1)) for i, s in enumerate(schemes))]

    monkeypatch.setattr(quantization_choice, "measure", measure)
    first = resolve_quantization(str(tiny_folder), AUTO)
    second = resolve_quantization(str(tiny_folder), AUTO)
    assert len(calls) == 1 and calls[0] == AVAILABLE
    assert first == second and first.scheme is SCHEMES[AVAILABLE[0]] and first.quantized
    (record,) = (home / "quantization").glob("*.json")
    key = json.loads(record.read_text())["key"]
    assert {"model", "cpu", "versions", "options"} <= key.keys() and key["versions"]["torch"] == torch.__version__
    model, _ = load_pretrained(str(tiny_folder), quantization=AUTO)
    assert len(calls) == 1
    assert model.dtype == SCHEMES[AVAILABLE[0]].dtype
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the same CPU with oneDNN capped: other kernels, a new verdict
    resolve_quantization(str(tiny_folder), AUTO)
    assert len(calls) == 2 and len(list((home / "quantization").glob("*.json"))) == 2


@pytest.mark.parametrize(("cap", "native"), [("avx2", False), ("AVX512_CORE", False), ("AVX512_CORE_AMX", None), (None, None)])
def test_a_onednn_instruction_cap_below_bf16_makes_bf16_emulated(monkeypatch, cap, native):
    """``None``: as the CPU's flags say."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    flags = set(machine.cpu_identity()["flags"])
    expected = bool({"avx512_bf16", "amx_bf16"} & flags) if native is None else native
    assert machine.native_bf16() is expected
    assert machine.machine_key()["kernels"] == {"aten": torch.backends.cpu.get_cpu_capability(),
                                                "onednn": cap.upper() if cap else None}


def test_measuring_a_tiny_model_covers_every_scheme_and_is_cached(home, tiny_folder):
    options = MeasureOptions(context=16, repeats=1, threads=1, screen_margin=float("inf"), losing=float("inf"))
    measurements = quantization.cached_measure(str(tiny_folder), AVAILABLE, options, windows=windows(), progress=False)
    assert [m.scheme for m in measurements] == [BASELINE.name, *AVAILABLE]
    for m in measurements:
        assert m.error is None, m
        assert m.decode_ms > 0 and m.verify_ms > 0 and m.decode_ratio > 0 and 0 <= m.top1 <= 1 and m.kl >= 0
        assert m.batch_invariant == (None if m.scheme == BASELINE.name else batch_invariant(m.scheme))
    assert measurements[0].top1 > 0.8  # bf16 against float32
    again = quantization.cached_measure(str(tiny_folder), AVAILABLE, options, windows=[], progress=False)
    assert again == measurements  # read back, not measured (no windows to measure on)
    assert "| bf16 | " in quantization.markdown_table(measurements)


# --------------------------------------------------------------------------- routing on quantised models


def load_quantized(folder: Path, name: str):
    scheme = SCHEMES[name]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=scheme.dtype, **scheme.from_pretrained_kwargs())
    return scheme.finish(model.eval())


@pytest.mark.parametrize("name", AVAILABLE)
def test_routing_skips_layers_of_a_quantised_model(tiny_folder, name):
    model = load_quantized(tiny_folder, name)
    ids = windows()[0]
    mask = RoutingMask.from_model(model, skip=[2, 3])
    layers = model.model.layers  # a skipped layer is still called; its forward returns at once, its MLP never runs
    with torch.no_grad(), TokensPerCall(layers[2].mlp) as skipped, TokensPerCall(layers[1].mlp) as kept:
        full = model(ids).logits
        with routed(model, mask):
            slim = model(ids).logits
    assert skipped.calls == [ids.shape[1]] and kept.calls == [ids.shape[1]] * 2
    assert not torch.equal(full, slim)


@pytest.mark.parametrize("name", AVAILABLE)
def test_lossless_viasd_on_a_quantised_target_keeps_one_cache_and_equals_generate_if_batch_invariant(
    home, tiny_folder, name, single_thread
):
    target = enable_viasd(load_quantized(tiny_folder, name))
    drafter = near_copy(AutoModelForCausalLM.from_pretrained(tiny_folder).eval(), scale=0.01)
    ids = windows()[1][:, :10]
    expected = target.generate(ids, max_new_tokens=16, output_logits=True, return_dict_in_generate=True, **GREEDY)
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[2]), mode="lossless", adaptive=False)
    out = target.generate(ids, assistant_model=drafter, viasd_config=config, viasd_check_invariants=True,
                          max_new_tokens=16, return_dict_in_generate=True, **GREEDY)  # fmt: skip
    assert_stats_consistent(out.viasd_stats, 16, "lossless")
    assert out.viasd_stats.slim_forwards > 0 and out.viasd_stats.accepted_tokens > 0
    if batch_invariant(name):  # as measured on this machine: then only the attention's rounding separates the two
        tie = bf16_near_tie(expected.logits)
        end = ids.shape[1] + (len(expected.logits) if tie is None else tie)
        assert torch.equal(out.sequences[:, :end], expected.sequences[:, :end])


# --------------------------------------------------------------------------- batch invariance, measured


def test_batch_invariance_is_measured_once_per_machine_then_read_from_the_cache(home, monkeypatch):
    measured = []

    def measure(name):
        measured.append(name)
        return Invariance(drift=0.0 if name == "bnb-4bit" else 0.01, unquantised_drift=0.0)

    monkeypatch.setattr(invariance, "measure_invariance", measure)
    assert batch_invariant("bnb-4bit") and not batch_invariant("torchao-int8") and batch_invariant("4bit")
    assert batch_invariant("bnb-4bit") and not batch_invariant("torchao-int8")
    assert measured == ["bnb-4bit", "torchao-int8"]
    (record,) = (home / "quantization").glob("batch-invariance-*.json")
    data = json.loads(record.read_text())
    assert set(data["schemes"]) == {"bnb-4bit", "torchao-int8"}
    assert data["key"]["cpu"]["model"] and data["key"]["versions"]["torch"] == torch.__version__


@pytest.mark.parametrize("corrupt", ["{not json", "[]", '{"schemes": {"bnb-4bit": {"drift": "x"}}}'])
def test_a_corrupt_batch_invariance_cache_is_measured_again(home, monkeypatch, corrupt):
    measured = []
    monkeypatch.setattr(invariance, "measure_invariance", lambda name: measured.append(name) or Invariance(0.0, 0.0))
    batch_invariant("bnb-4bit")
    (record,) = (home / "quantization").glob("batch-invariance-*.json")
    record.write_text(corrupt)
    assert batch_invariant("bnb-4bit") and measured == ["bnb-4bit", "bnb-4bit"]
    assert json.loads(record.read_text())["schemes"]["bnb-4bit"] == {"drift": 0.0, "unquantised_drift": 0.0}


def test_one_activation_scale_per_pass_is_measured_as_batch_dependent(home):
    """torch.ao scales a pass's activations by its largest one, so a row's output depends on the others by design."""
    verdict = invariance.invariance("torch-dynamic-int8")
    assert verdict.drift > 0 and not verdict.batch_invariant


def bf16_near_tie(logits: tuple[torch.Tensor, ...]) -> int | None:
    """First position whose top-2 gap is within 4 bf16 ulps of the top logit: a step and a block may differ there."""
    for position, row in enumerate(logits):
        top2 = row[0].float().topk(2).values
        ulp = 2.0 ** (torch.floor(torch.log2(top2[0].abs())) - 7)
        if top2[0] - top2[1] < 4 * ulp:
            return position
    return None


@pytest.mark.integration
def test_lossless_viasd_on_a_4bit_checkpoint_equals_generate():
    """A real checkpoint, its slim verifier and its self-drafter both routed on the NF4 weights."""
    target, tokenizer = load_pretrained("smollm2-135m-instruct", quantization="4bit")
    enable_viasd(target)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]  # fmt: skip
    reference = target.generate(ids, max_new_tokens=16, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)  # fmt: skip
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[3]), mode="lossless", adaptive=False,
                         self_draft_mask=RoutingMask.from_model(target, skip=[3, 5, 9, 12]))  # fmt: skip
    out = target.generate(ids, viasd_config=config, viasd_check_invariants=True, max_new_tokens=16, do_sample=False,
                          return_dict_in_generate=True)  # fmt: skip
    tie = bf16_near_tie(reference.logits)
    end = ids.shape[1] + (len(reference.logits) if tie is None else tie)
    assert torch.equal(out.sequences[:, :end], reference.sequences[:, :end])
    assert out.viasd_stats.accepted_tokens > 0 and out.viasd_stats.slim_forwards > 0


def test_bench_quantizes_every_method_alike_and_compares_with_the_bf16_pair(home, tiny_folder, tmp_path):
    from viasd_hf.cli import main

    prompts, report = tmp_path / "prompts.jsonl", tmp_path / "bench.json"
    prompts.write_text(json.dumps({"prompt": "w3 w4 w5 w6 w7 w8"}) + "\n")
    folder = str(tiny_folder)
    assert main(["bench", "--target", folder, "--drafter", folder, "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--methods", "greedy,hf_assisted,two_tier,hf_assisted_bf16", "--json", str(report),
                 "--quantize", "drafter=bnb-4bit,target=4bit"]) == 0  # fmt: skip
    data = json.loads(report.read_text())
    assert {role: q["scheme"] for role, q in data["quantization"].items()} == {"drafter": "bnb-4bit", "target": "bnb-4bit"}
    assert data["quantization"]["target"]["requested"] == "4bit"
    assert len(data["outputs"]["hf_assisted_bf16"]) == 1 and "speedup_vs_greedy" in data["methods"]["hf_assisted_bf16"]
    if batch_invariant("bnb-4bit"):  # on this machine: the same quantised target as greedy, one token or a block
        assert data["methods"]["two_tier"]["quality"]["greedy_agreement"] == 1.0
