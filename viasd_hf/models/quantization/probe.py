"""A one-layer model to measure kernels on: a second to save and to load in any form, so a fact about the
kernels (their speed at a model's width, their batch invariance) costs no full model load."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig


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
