"""Attention masks from token positions, for models with sliding-window layers decoding in a batch.

transformers measures a sliding window in cache columns: a key is in a query's window when its column is less than
``sliding_window`` before the query's (``masking_utils.sliding_window_overlay``), and a ``DynamicSlidingWindowLayer``
keeps only the columns the next window needs. Both hold in ``generate``'s left-padded batches, where each row's tokens
are contiguous. In a ragged cache they are not: a rejected draft, or a pass's per-row padding, leaves a hole between
two tokens of a row, so the column distance overstates the token distance, and a window counted in columns would hide
tokens the row's own window sees (as an eviction by columns would drop them).

So for a model with sliding-window layers the ragged cache keeps every column (each layer a plain ``DynamicLayer``)
and hands the model its attention masks ready-made, computed from positions (a token's position is the number of
its row's tokens before it, as the position ids are): key column ``c`` is visible to the query at position ``q``
when ``c`` holds a token of the row whose position ``k`` is at most ``q`` and, in a sliding layer,
``q - k < sliding_window``. transformers takes a 4D mask as it is (``masking_utils._preprocess_mask_arguments``),
and a model whose layers differ in kind takes one per kind in a dict by layer type (``{"full_attention": ...,
"sliding_attention": ...}``, as ``generate`` prepares them), so no model code changes. Each mask is in the form the
model's attention implementation reads: boolean (True: attend) for SDPA (and for ``engine.attention``'s kernels,
which run in its place and convert it themselves), additive (0, or the dtype's minimum) for eager attention.

Windows are read from the config as transformers' own cache reads them (``cache_utils.get_layer_types_and_kwargs``:
``config.layer_types``, else ``sliding_window`` per layer), never from a list of model types. Models whose layers are
all full attention are not served here: with no window, columns order a row's tokens as positions do, and
transformers' own masks from the 2D mask are right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from viasd_hf.engine.attention import STEERED

FULL = "full_attention"
SLIDING = "sliding_attention"
MASK_KINDS = ("sdpa", "eager", STEERED)  # attention implementations that read a 4D mask as given


def layer_windows(config: PretrainedConfig) -> list[tuple[str, int | None]]:
    """Each decoder layer's kind (``config.layer_types``' names) and, for a sliding one, its window."""
    kinds, settings = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(settings, dict):  # transformers releases before per-layer configs: one set of settings for all
        settings = [settings] * len(kinds)
    return [(kind, setting.get("sliding_window") if kind == SLIDING else None) for kind, setting in zip(kinds, settings)]


def unmaskable(config: PretrainedConfig) -> str | None:
    """Why a batch's masks cannot stand for this model's attention, or None where they can: a layer of another kind
    than full or sliding-window attention (chunked, linear, a shared cache...), sliding layers of several windows, or,
    with sliding layers, an attention implementation that reads no 4D mask (flash, flex)."""
    layers = layer_windows(config)
    others = sorted({kind for kind, _ in layers} - {FULL, SLIDING})
    if others:
        return f"has {', '.join(others)} layers, which a batch's masks cannot describe"
    if len({window for kind, window in layers if kind == SLIDING}) > 1:
        return "has sliding-window layers of several windows, which share one mask per layer type"
    implementation = attention_implementation(config)
    if any(kind == SLIDING for kind, _ in layers) and implementation not in MASK_KINDS:
        return (f"has sliding-window layers, which a batch masks by position with a 4D mask, and "
                f"attn_implementation={implementation!r} reads none (load it with attn_implementation='sdpa')")
    return None


@dataclass(frozen=True)
class SlidingWindows:
    """A model's attention by layer kind: each kind's window (``None``: full attention)."""

    windows: dict[str, int | None]

    @classmethod
    def of(cls, config: PretrainedConfig) -> SlidingWindows | None:
        """``config``'s windows; None where no layer has one (``unmaskable`` says which models are served)."""
        windows = dict(layer_windows(config))
        return cls(windows) if any(window is not None for window in windows.values()) else None

    def masks(self, held: torch.Tensor, positions: torch.Tensor, queries: int,
              model: nn.Module) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention masks ``[rows, 1, queries, columns]`` of a pass whose queries are the last ``queries`` of the
        columns (``held``: which hold a token of the row; ``positions``: the row's tokens before each, minus one), in
        ``model``'s form: one for every layer where all are of one kind, else one per kind."""
        query = positions[:, None, -queries:, None]
        key = positions[:, None, None, :]
        seen = held.bool()[:, None, None, :] & (key <= query)  # holes and later tokens hidden: causal by position
        return by_kind(seen, positions, self.windows, model)


def beside_masks(held: torch.Tensor, real: torch.Tensor, stands_in: torch.Tensor, positions: torch.Tensor,
                 model: nn.Module) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention masks ``[rows, 1, queries, columns]`` of a pass that feeds, beside a draft, alternatives to some
    of its tokens (``engine.batch.second_choices``). ``held``: which cache columns hold a token of the row; ``real``:
    which of the pass's columns do; ``stands_in[r, c]``: for a column fed beside the draft, the pass's column of the
    token it is an alternative to, for every other column its own. A column sees the row's cache, itself, and the
    draft's columns before the one it stands in for (so an alternative sees what the token it would replace sees, and
    nothing fed beside the draft is seen by another column); ``positions`` (every column's) bound sliding windows."""
    queries = real.shape[1]
    column = torch.arange(queries, device=real.device)
    in_draft = stands_in == column  # [rows, queries]
    new = (column[None, None, :] == column[None, :, None]) | (
        (column[None, None, :] < stands_in[:, :, None]) & in_draft[:, None, :])
    seen = torch.cat([held.bool()[:, None, :].expand(-1, queries, -1), new & real[:, None, :]], dim=-1)[:, None]
    return by_kind(seen, positions, dict(layer_windows(model.config)), model)


def by_kind(seen: torch.Tensor, positions: torch.Tensor, windows: dict[str, int | None],
            model: nn.Module) -> torch.Tensor | dict[str, torch.Tensor]:
    """``seen`` (``[rows, 1, queries, columns]``, True: attend), bounded in each sliding kind of layer by its window
    (``positions``: every column's), in ``model``'s form: one mask where all layers are of one kind, else one per kind."""
    query = positions[:, None, -seen.shape[2]:, None]
    key = positions[:, None, None, :]
    masks = {kind: in_form(seen if window is None else seen & (query - key < window), model)
             for kind, window in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def attention_implementation(config: PretrainedConfig) -> str | None:
    """The attention the decoder runs (a composite model's text part's)."""
    return config.get_text_config(decoder=True)._attn_implementation


def in_form(attends: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """A boolean mask (True: attend) as ``model``'s attention reads it: as it is for SDPA, additive for eager."""
    if attention_implementation(model.config) != "eager":
        return attends
    dtype = model.dtype
    return torch.zeros(attends.shape, dtype=dtype, device=attends.device).masked_fill(~attends, torch.finfo(dtype).min)
