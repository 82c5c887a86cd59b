"""Where the decoder layers of a supported model live, and how a skipped layer passes its input on.

Layer skipping has to know two things per architecture: the ``ModuleList`` of decoder layers and
what a layer returns (transformers 5 decoder-only layers return a plain tensor; T5 blocks return
``(hidden_states, position_bias, encoder_decoder_position_bias)``). Everything architecture
specific is kept in this one module so an unsupported model fails loudly in one place.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

DECODER_ONLY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ENCODER_DECODER_TYPES = ("t5", "mt5")
SUPPORTED_TYPES = DECODER_ONLY_TYPES + ENCODER_DECODER_TYPES

# Config keys that define the computation of a model; everything else (paths, dtypes,
# quantisation, generation defaults) may differ between two loads of the same weights.
_ARCHITECTURE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "hidden_activation",
    "layer_types",
    "sliding_window",
    "max_window_layers",
    "rope_theta",
    "rope_parameters",
    "rms_norm_eps",
    "tie_word_embeddings",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "d_model",
    "d_ff",
    "d_kv",
    "num_heads",
    "num_layers",
    "num_decoder_layers",
    "feed_forward_proj",
    "relative_attention_num_buckets",
)


class UnsupportedArchitectureError(ValueError):
    """The model's architecture has no known decoder-layer layout for routing."""


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under any PEFT wrapper."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def model_config(model: nn.Module) -> PretrainedConfig:
    return base_model(model).config


def model_type(model: nn.Module) -> str:
    kind = getattr(model_config(model), "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route layers of model_type={kind!r} "
            f"({type(base_model(model)).__name__}). Supported model types: {', '.join(SUPPORTED_TYPES)}. "
            "Open an issue with the model id to get it added."
        )
    return kind


def is_encoder_decoder(model: nn.Module) -> bool:
    return model_type(model) in ENCODER_DECODER_TYPES


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layers in execution order (works through PEFT, bitsandbytes and accelerate)."""
    model_type(model)
    base = base_model(model)
    decoder = base.get_decoder()
    return decoder.block if is_encoder_decoder(model) else decoder.layers


def num_decoder_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def protected_layers(model: nn.Module) -> dict[int, str]:
    """Layers that must never be skipped, with the reason, keyed by index.

    transformers derives positions, cache length and attention-mask sizes from particular
    layers (layer 0; the first full-attention and the first sliding-window layer); the last
    layer feeds the final norm and LM head that every tier shares; T5's first block owns the
    relative position bias that all later blocks reuse.
    """
    count = num_decoder_layers(model)
    reasons = {0: "the first layer (positions and cache length are read from it)"}
    if is_encoder_decoder(model):
        reasons[0] = "the first block (it computes the relative position bias every block reuses)"
    layer_types = getattr(model_config(model), "layer_types", None)
    if layer_types:
        if "full_attention" in layer_types:
            first_full = layer_types.index("full_attention")
            reasons.setdefault(first_full, "the first full-attention layer (attention masks are sized from it)")
        if "sliding_attention" in layer_types:
            first_sliding = layer_types.index("sliding_attention")
            reasons.setdefault(first_sliding, "the first sliding-window layer (sliding masks are sized from it)")
    reasons.setdefault(count - 1, "the last layer (it feeds the shared final norm and LM head)")
    return dict(sorted(reasons.items()))


def config_fingerprint(model: nn.Module) -> str:
    """A short hash of the architecture-defining config of the model (not its dtype or path)."""
    config = model_config(model).to_dict()
    identity = {key: config[key] for key in _ARCHITECTURE_KEYS if key in config}
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def skipping_forward(layer: nn.Module, model: nn.Module) -> Callable[..., Any]:
    """A ``forward`` for ``layer`` that returns what the layer would return had it been the identity."""
    if not is_encoder_decoder(model):

        def skip_decoder_layer(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            return hidden_states

        return skip_decoder_layer

    signature = inspect.signature(type(layer).forward)

    def skip_t5_block(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(layer, hidden_states, *args, **kwargs).arguments
        return hidden_states, bound.get("position_bias"), bound.get("encoder_decoder_position_bias")

    return skip_t5_block
