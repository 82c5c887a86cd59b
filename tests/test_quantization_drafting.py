"""``auto`` for a drafter: judged by its target, chosen by how fast the target decodes with it (``quantization.drafting``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, tiny_causal_lm
from viasd_hf.models.quantization import (
    AUTO,
    BASELINE,
    SCHEMES,
    Measurement,
    MeasureOptions,
    QuantizationError,
    choose_drafter,
    markdown_table,
    measure,
    resolve_quantization,
)
from viasd_hf.models.quantization import choice as quantization_choice
from viasd_hf.models.quantization.drafting import block_throughput

DIMS = dict(hidden_size=128, intermediate_size=256, initializer_range=0.2)
AVAILABLE = [name for name, scheme in SCHEMES.items() if scheme.available]


def save_tiny(path: Path, seed: int, vocab: int = VOCAB, **overrides) -> Path:
    tiny_causal_lm("llama", seed=seed, **(DIMS | overrides)).save_pretrained(path)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return path


def judged(scheme: str, ratio: float, top1: float, judge_bytes: float = 0.35) -> Measurement:
    return Measurement(scheme, decode_ms=100 * ratio, verify_ms=120 * ratio, decode_ratio=ratio, verify_ratio=ratio,
                       top1=top1, kl=0.5, judge_bytes=judge_bytes)  # fmt: skip


def test_a_cheaper_or_better_drafter_makes_its_target_faster():
    assert block_throughput(0.75, 0.2) > block_throughput(0.75, 0.35) > block_throughput(0.75, 1.0)
    assert block_throughput(0.8, 0.35) > block_throughput(0.7, 0.35)
    assert block_throughput(0.0, 0.35) == pytest.approx(1 / (1.35 + 0.06)), "a useless drafter still drafts once"


def test_a_drafter_is_quantised_when_its_target_decodes_faster_even_if_it_agrees_less():
    """Half the cost at 0.70 instead of 0.75 agreement pays; a third of the cost at 0.30 does not. A drafter need not be
    batch-invariant: its target keeps or replaces what it proposes."""
    measurements = [judged("bf16", 1.0, 0.75), judged("bnb-4bit", 0.5, 0.70), judged("torch-dynamic-int8", 0.33, 0.30),
                    Measurement("torchao-int8", error="ImportError: no torchao")]  # fmt: skip
    name, reason = choose_drafter(measurements)
    assert name == "bnb-4bit" and "target agreement 0.700 vs 0.750" in reason
    assert "torch-dynamic-int8: its target decodes 0." in reason and "torchao-int8: ImportError" in reason
    assert choose_drafter(measurements[:1] + measurements[2:])[0] == BASELINE.name
    table = markdown_table(measurements)
    assert "top-1 with target" in table and "| bnb-4bit |" in table and "| yes |" in table


def test_choosing_a_drafter_needs_a_judge():
    with pytest.raises(ValueError, match="judged by its target"):
        choose_drafter([Measurement("bf16", decode_ratio=1.0, top1=0.9), Measurement("bnb-4bit", decode_ratio=0.5, top1=0.8)])


def test_a_drafter_is_measured_against_its_target(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))  # where the batch-invariance verdicts go
    drafter = save_tiny(tmp_path / "drafter", seed=1, num_hidden_layers=2)
    target = save_tiny(tmp_path / "target", seed=2, num_hidden_layers=8)
    alone = MeasureOptions(context=16, repeats=1, threads=1, screen_margin=float("inf"), losing=float("inf"))
    windows = [tiny_ids(seed) for seed in range(2)]
    on_self, on_target = (measure(str(drafter), AVAILABLE[:1], o, windows=windows, progress=False)[0]
                          for o in (alone, dataclasses.replace(alone, judge=str(target))))  # fmt: skip
    assert on_self.judge_bytes is None and on_self.top1 > 0.8
    assert on_target.top1 < 0.5, "two unrelated random models rarely agree"
    assert 0.2 < on_target.judge_bytes < 1.0


def test_a_judge_with_another_tokenizer_is_refused(tmp_path):
    drafter = save_tiny(tmp_path / "drafter", seed=1)
    target = save_tiny(tmp_path / "target", seed=2, vocab=VOCAB - 1, vocab_size=VOCAB - 1)
    with pytest.raises(QuantizationError, match="tokenize differently"):
        measure(str(drafter), AVAILABLE[:1], MeasureOptions(repeats=1, threads=1, judge=str(target)), progress=False)


@pytest.mark.parametrize("fp16_native", [False, True], ids=["fp16 converted", "fp16 native"])
def test_auto_for_a_drafter_is_measured_against_its_target_and_cached_apart(fp16_native, tmp_path, monkeypatch):
    """fp16 is a candidate only where the CPU computes in it, whatever CPU runs the test."""
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(quantization_choice, "native_fp16", lambda: fp16_native)
    unquantised = ["fp32", "fp16"] if fp16_native else ["fp32"]
    judges = []

    def fake_measure(name_or_path, schemes, options, **kwargs):
        judges.append(options.judge)
        if options.judge is None:
            return [judged("bf16", 1.0, 0.99, None), *(judged(s, 0.5, 0.5, None) for s in schemes)]
        assert schemes[: len(unquantised)] == unquantised, "a drafter's unquantised forms are candidates too"
        quantised = schemes[len(unquantised):]
        return [judged("bf16", 1.0, 0.75), judged("fp32", 1.4, 0.75), *(judged(s, 1.0, 0.75) for s in unquantised[1:]),
                *(judged(s, 0.5, 0.72) for s in quantised)]  # fmt: skip

    monkeypatch.setattr(quantization_choice, "measure", fake_measure)
    as_drafter = resolve_quantization("some-drafter", AUTO, draft_for="some-target")
    alone = resolve_quantization("some-drafter", AUTO)
    assert resolve_quantization("some-drafter", AUTO, draft_for="some-target") == as_drafter
    assert judges == ["some-target", None], "measured once per judge, then read from the cache"
    assert as_drafter.scheme is SCHEMES[AVAILABLE[0]] and not alone.quantized


def tiny_ids(seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 20), generator=torch.Generator().manual_seed(seed))
