"""Where a model's decoder layers live, which of them must run, and how a skipped layer passes its input on.

Everything is read from the model itself, not from a list of model types:

- **The layer list** is the ``nn.ModuleList`` nearest the top of the decoder (``get_decoder()``): ``model.layers``
  for Llama-style models, ``transformer.h`` for GPT-2, Falcon and BLOOM, ``model.decoder.layers`` for OPT,
  ``decoder.block`` for T5. A decoder with two such lists at the same depth is refused: which one is the stack
  cannot be told.
- **What a layer returns** is seen once, in a pass that stops right after the first layer (``_returned_form``):
  transformers 5 decoder layers mostly return the hidden states, some (Falcon, BLOOM) a tuple whose first item
  they are. A skipped layer returns the same form, its input in place of its output. T5-style blocks also pass
  their position biases on; a skipped block hands on the ones it was given.
- **Which layers must run** (``protected_layers``) follows from ``config.layer_types``: transformers sizes masks
  and caches from the first layer of each attention kind.
- **What cannot be skipped**: state-space and recurrent layers (Mamba, RecurrentGemma, Jamba, hybrid linear
  attention) carry a state through every token, so a skipped layer would leave its state behind; they are refused
  with the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from viasd_hf.masks.per_model_cache import PerModelCache

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

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
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "ffn_dim",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "partial_rotary_factor",
    "rotary_pct",
    "logit_scale",
    "residual_multiplier",
    "embedding_multiplier",
)


class UnsupportedArchitectureError(ValueError):
    """The model's decoder cannot be routed: no single layer list, or layers whose skipping cannot be expressed."""


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under any PEFT wrapper."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def model_config(model: nn.Module) -> PretrainedConfig:
    return base_model(model).config


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(model_config(model), "is_encoder_decoder", False))


_layer_lists: PerModelCache[nn.ModuleList] = PerModelCache()
_returned_forms: PerModelCache[int] = PerModelCache()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layers in execution order (works through PEFT, bitsandbytes and accelerate); raises
    ``UnsupportedArchitectureError`` for a model whose layers cannot be skipped, naming why."""
    base = base_model(model)
    return _layer_lists.get(base, "layers", lambda: _find_layer_list(base))


def check_routable(model: nn.Module) -> None:
    """Raise ``UnsupportedArchitectureError`` unless ``model``'s decoder layers can be skipped one by one."""
    decoder_layers(model)


def num_decoder_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def _find_layer_list(model: PreTrainedModel) -> nn.ModuleList:
    if getattr(model, "config", None) is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is not a transformers model (it has no config), so it has no decoder layers to "
            "skip; pass the causal LM itself (AutoModelForCausalLM.from_pretrained(...))")
    name = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    _refuse_recurrent_layers(model.config, name)
    get_decoder = getattr(model, "get_decoder", None)
    decoder = (get_decoder() if callable(get_decoder) else None) or model
    by_depth: dict[int, list[tuple[str, nn.ModuleList]]] = {}
    for path, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and path:
            by_depth.setdefault(path.count("."), []).append((path, module))
    if not by_depth:
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route {name}: its decoder has no nn.ModuleList of layers, so there is no layer to skip"
        )
    found = by_depth[min(by_depth)]
    if len(found) > 1:
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route {name}: its decoder has {len(found)} layer lists side by side "
            f"({', '.join(path for path, _ in found)}), so which one is the decoder stack cannot be told"
        )
    return found[0][1]


def _refuse_recurrent_layers(config: PretrainedConfig, name: str) -> None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = sorted({kind for kind in getattr(text, "layer_types", None) or () if kind not in ATTENTION_LAYER_TYPES})
    if kinds or _state_space(text):
        what = ", ".join(map(repr, kinds)) or "state-space"
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route {name}: it has {what} layers, which carry a recurrent state through every token, "
            "so a skipped layer would leave its state behind for the next tokens; only models whose decoder layers "
            "are all attention layers (full, sliding-window or chunked) can be routed. Use plain generate, or HF "
            "assisted generation, with this model"
        )


def _state_space(config: PretrainedConfig) -> bool:
    """State-space models that name no ``layer_types`` (their configs set ``state_size`` or ``ssm_*`` fields)."""
    return any(getattr(config, field, None) for field in ("state_size", "ssm_state_size", "mamba_d_state"))


def protected_layers(model: nn.Module) -> dict[int, str]:
    """Layers that must never be skipped, with the reason, keyed by index.

    transformers derives positions, cache length and attention-mask sizes from particular
    layers (layer 0; the first layer of each attention kind); the last layer feeds the final
    norm and LM head that every tier shares; T5's first block owns the relative position bias
    that all later blocks reuse.
    """
    count = num_decoder_layers(model)
    reasons = {0: "the first layer (positions and cache length are read from it)"}
    if is_encoder_decoder(model):
        reasons[0] = "the first block (it computes the relative position bias every block reuses)"
    layer_types = list(getattr(model_config(model).get_text_config(decoder=True), "layer_types", None) or ())
    for kind in dict.fromkeys(layer_types[:count]):
        name = {"sliding_attention": "sliding-window"}.get(kind, kind.replace("_", "-"))
        reasons.setdefault(layer_types.index(kind), f"the first {name} layer (its attention masks are sized from it)")
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
    if is_encoder_decoder(model):
        return _skip_t5_style_block(layer, model)
    form = returned_form(model)
    if form == 0:

        def skip_decoder_layer(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            return hidden_states

        return skip_decoder_layer
    extras = (None,) * (form - 1)  # attention weights and the like, which nothing downstream reads unless asked for

    def skip_tuple_returning_layer(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return (hidden_states, *extras)

    return skip_tuple_returning_layer


def returned_form(model: nn.Module) -> int:
    """What the decoder's layers return: 0 for the hidden states, ``n`` for a tuple of ``n`` (hidden states first)."""
    base = base_model(model)
    return _returned_forms.get(base, "form", lambda: _returned_form(base))


class _FirstLayerRan(Exception):
    def __init__(self, output: Any) -> None:
        self.output = output


def _returned_form(model: PreTrainedModel) -> int:
    """Run the model on one token until its first layer has returned (that layer always runs: ``protected_layers``)."""
    def stop(module: nn.Module, args: Any, output: Any) -> None:
        raise _FirstLayerRan(output)

    handle = decoder_layers(model)[0].register_forward_hook(stop)
    device = model.get_input_embeddings().weight.device
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
    except _FirstLayerRan as ran:
        output = ran.output
    else:
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route {type(model).__name__}: its first decoder layer did not run in a forward pass"
        )
    finally:
        handle.remove()
    if isinstance(output, torch.Tensor):
        return 0
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return len(output)
    raise UnsupportedArchitectureError(
        f"viasd_hf cannot route {type(model).__name__}: its decoder layers return {type(output).__name__}, "
        "neither the hidden states nor a tuple that starts with them"
    )


def _skip_t5_style_block(layer: nn.Module, model: nn.Module) -> Callable[..., Any]:
    """T5-style blocks return ``(hidden_states, position_bias, encoder_decoder_position_bias)``; the biases computed by
    the first block flow through every later one, so a skipped block hands on those it was given."""
    signature = inspect.signature(type(layer).forward)
    if "position_bias" not in signature.parameters:
        raise UnsupportedArchitectureError(
            f"viasd_hf cannot route {type(base_model(model)).__name__}: of encoder-decoder models it routes T5-style "
            "decoders (blocks that pass a position bias on); use a decoder-only model or T5"
        )

    def skip_t5_block(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(layer, hidden_states, *args, **kwargs).arguments
        return hidden_states, bound.get("position_bias"), bound.get("encoder_decoder_position_bias")

    return skip_t5_block
