"""A one-layer model to measure kernels on: a second to save and to load in any form, so a fact about the
kernels (their speed at a model's width, their batch invariance) costs no full model load. The screen runs it
in every form before any full model is loaded in one, to rule out the forms that cannot win here."""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from viasd_hf.models.quantization.schemes import FORMS, UNQUANTIZED, load_in


@contextmanager
def probe_checkpoint(hidden_size: int, intermediate_size: int) -> Iterator[Path]:
    """A one-layer llama with this MLP, saved in a temporary folder (random weights, the same every time)."""
    config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)  # fmt: skip
    with torch.random.fork_rng(), tempfile.TemporaryDirectory(prefix="viasd-probe-") as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        yield Path(folder)


def probe_mlp(model: nn.Module) -> nn.Module:
    """The MLP of a probe model: its linear layers in the model's form, row-wise by construction."""
    return model.get_decoder().layers[0].mlp


def failure(error: Exception) -> str:
    """Why a form failed, in one line."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


@torch.no_grad()
def _layer_ms(mlp: nn.Module, width: int, dtype: torch.dtype, repeats: int = 5) -> float:
    row = torch.randn(1, 1, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    mlp(row)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mlp(row)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def screen(config: PretrainedConfig, names: Sequence[str]) -> dict[str, float | str]:
    """Per form, its one-token pass of one MLP layer of the model's width in ms, or why it failed to run."""
    text = config.get_text_config()
    results: dict[str, float | str] = {}
    with probe_checkpoint(text.hidden_size, text.intermediate_size) as folder:
        for name in names:
            try:
                form = FORMS[name]
                results[name] = _layer_ms(probe_mlp(load_in(folder, form)), text.hidden_size, form.dtype)
            except Exception as error:  # noqa: BLE001 — a form that cannot run on this machine is a result
                results[name] = failure(error)
            gc.collect()
    return results


def ruled_out_by_screen(layer: dict[str, float | str], margin: float) -> dict[str, str]:
    """Why each form is not loaded: it failed the screen, or its layer pass is over ``margin`` times the fastest. An
    unquantised form is never ruled out by speed: a one-token pass cannot show what it is worth (where bf16 is emulated
    float32's is twice bf16's, while its passes over several tokens are cheaper)."""
    fastest = min((ms for ms in layer.values() if isinstance(ms, float)), default=None)
    reasons = {}
    for name, ms in layer.items():
        if isinstance(ms, str):
            reasons[name] = ms
        elif name not in UNQUANTIZED and ms > margin * fastest:
            reasons[name] = f"ruled out: its layer pass takes {ms / fastest:.1f}× the fastest form's"
    return reasons
