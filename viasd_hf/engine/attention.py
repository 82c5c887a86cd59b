"""Short-query attention through whichever kernel is measured fastest on this machine: SDPA, the model's eager one, or
SDPA over grouped queries.

PyTorch's CPU SDPA kernel is built for long query blocks. For the 1–30 query rows of a drafting or
verifying pass over a long KV cache it can be far slower than the plain matmul–softmax–matmul of
the model's own eager attention: one pass of the 4-bit Qwen2.5-Coder 0.5B drafter over 1,000 cached
tokens took 52 ms with SDPA and 27 ms with eager attention (AMD EPYC, one thread), and drafting and
verifying are nearly all such passes.

Where query heads share key/value heads (grouped-query attention) and a pass has a mask and several
query rows (every verifying pass, and every pass over a padded batch), transformers copies each
key/value head once per query head that reads it (``repeat_kv``) before either kernel runs: the whole
cache, copied in every layer of every pass. The third kernel (``_grouped_sdpa``) folds the query
heads that share a key/value head into that head's query rows, so SDPA reads the cache as it is:
the same sums, none of the copies. A pass of Qwen2.5-Coder 1.5B (12 query heads, 2 key/value heads,
bf16) over 4 tokens a row, 4 rows of 750 cached tokens, took 236 ms with it against 272 ms with SDPA
(Intel Xeon with AMX, two threads; ``bench/studies/attention_kernel``).

Which kernel wins depends on the CPU, dtype and shapes, so it is measured, not assumed: the first
call of each shape bucket (``Bucket``) runs every kernel that computes the call on its real inputs
and the fastest one is remembered for the process (``kernel_choices``), as
``torch.backends.cudnn.benchmark`` does on GPUs.

Only calls made inside ``fastest_attention()`` are steered, and only on CPU, on models configured
for SDPA; everything else (plain ``generate`` in another thread included) runs SDPA exactly as
before. The steering function replaces ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` only while some call is
inside the context (reference counted), so outside them transformers is as it was.

Both kernels compute the same attention; they round differently (in bf16 visibly), so the choice
is left to measurement only where timings may steer the output (``tier_controller.measures_wall_clock``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

LONGEST_QUERY = 64  # query rows beyond this are a prefill: SDPA's own ground
TIMED_RUNS = 3  # runs of each kernel, interleaved, when a bucket is first met; the fastest run counts

_STEERED: ContextVar[bool] = ContextVar("viasd_fastest_attention", default=False)
_LOCK = threading.Lock()
_installed: dict[str, Any] = {"users": 0, "sdpa": None}
_choices: dict[Bucket, str] = {}
_LAST_ADDITIVE: ContextVar[tuple[torch.Tensor, int, torch.dtype, torch.Tensor] | None] = ContextVar(
    "viasd_last_additive_mask", default=None)  # every layer of a pass gets the same boolean mask: convert it once


class Bucket(NamedTuple):
    """Calls timed as one: the same attention class, dtype and head shape, query rows and cache length rounded up
    to powers of two."""

    attention: type
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    query_rows: int
    kv_length: int

    @classmethod
    def of(cls, module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> Bucket:
        def rounded(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

        return cls(type(module), query.dtype, query.shape[1], key.shape[1], query.shape[3],
                   rounded(query.shape[2]), rounded(key.shape[2]))


def kernel_choices() -> dict[Bucket, str]:
    """What has been measured in this process: ``"eager"`` or ``"sdpa"`` per bucket."""
    with _LOCK:
        return dict(_choices)


def forget_kernel_choices() -> None:
    """Measure every bucket again on its next call (after the machine's load changed, or in tests)."""
    with _LOCK:
        _choices.clear()


@contextmanager
def fastest_attention(enabled: bool = True) -> Iterator[None]:
    """Within this context (this thread or task only), short-query attention runs the kernel measured faster."""
    if not enabled:
        yield
        return
    _install()
    token = _STEERED.set(True)
    try:
        yield
    finally:
        _STEERED.reset(token)
        _uninstall()


def _install() -> None:
    with _LOCK:
        if _installed["users"] == 0:
            _installed["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = _steered_sdpa
        _installed["users"] += 1


def _uninstall() -> None:
    with _LOCK:
        _installed["users"] -= 1
        if _installed["users"] == 0:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]  # our override; beneath it, transformers' own or an earlier override
            if ALL_ATTENTION_FUNCTIONS["sdpa"] is not _installed["sdpa"]:
                ALL_ATTENTION_FUNCTIONS["sdpa"] = _installed["sdpa"]


def _steered_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """SDPA, unless this call is steered and another kernel that computes it is measured faster for its bucket."""
    sdpa = _installed["sdpa"]
    kernels = _kernels(module, query, key, value, attention_mask, args, kwargs) if _STEERED.get() else {}
    if not kernels:
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    kernels["sdpa"] = lambda: sdpa(module, query, key, value, attention_mask, **kwargs)
    bucket = Bucket.of(module, query, key)
    with _LOCK:
        choice = _choices.get(bucket)
    if choice is None:
        choice, output = _measure(kernels)
        with _LOCK:
            _choices.setdefault(bucket, choice)
        return output
    return kernels[choice]()


def _kernels(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, args: tuple, kwargs: dict) -> dict[str, Callable[[], Any]]:
    """The kernels besides SDPA that compute this call, each ready to run: none where SDPA must (a long query,
    training, a GPU, positional arguments)."""
    if args or query.device.type != "cpu" or module.training or query.shape[2] > LONGEST_QUERY:
        return {}
    kernels = {}
    eager = _eager_of(module, query, attention_mask, kwargs)
    if eager is not None:  # the mask is converted for eager attention only where eager attention runs
        kernels["eager"] = lambda: eager(module, query, key, value, _additive(attention_mask, query.dtype), **kwargs)
    if _groups_fold(module, query, attention_mask, kwargs):
        kernels["grouped"] = lambda: _grouped_sdpa(module, query, key, value, attention_mask, **kwargs)
    return kernels


def _eager_of(module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
              kwargs: dict) -> Callable | None:
    """The model's own eager attention, where it computes what SDPA would: no dropout, a mask given wherever causality
    needs one (SDPA infers it from ``is_causal`` without a mask; eager cannot), no position bias (T5's, which SDPA
    folds in itself). Not in float64: transformers' eager attention takes its softmax in float32, so it would be
    less exact than SDPA there."""
    if query.dtype == torch.float64:
        return None
    if (attention_mask is None and query.shape[2] > 1) or kwargs.get("position_bias") is not None:
        return None
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _groups_fold(module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether ``_grouped_sdpa`` computes this call: query heads share key/value heads, the query has several rows
    (transformers folds a single one itself) under a mask that every head shares, and nothing else changes the
    scores (no position bias, soft cap or dropout)."""
    if getattr(module, "num_key_value_groups", 1) <= 1 or query.shape[2] == 1:
        return False
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return False
    return (kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("dropout") and not kwargs.get("output_attentions"))


def _grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor, scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """SDPA with each key/value head read once: the ``groups`` query heads that share it become ``groups`` blocks of
    its query rows, each block under the same mask, instead of the key/value head being copied ``groups`` times.
    Query head ``h`` reads key/value head ``h // groups``, as ``repeat_kv`` pairs them."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * rows, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * rows, -1)
    output = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA's boolean mask (True: attend) as eager attention's additive one (0, or the dtype's minimum), converted
    once per pass: the layers of a pass share one mask object."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    last = _LAST_ADDITIVE.get()
    if last is not None and last[0] is mask and last[1] == mask._version and last[2] == dtype:  # unchanged since
        return last[3]
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    additive = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), blocked)
    _LAST_ADDITIVE.set((mask, mask._version, dtype, additive))
    return additive


def _measure(kernels: dict[str, Callable[[], Any]]) -> tuple[str, Any]:
    """Every kernel, interleaved, ``TIMED_RUNS`` times each: the fastest one's name and its output."""
    best, outputs = dict.fromkeys(kernels, float("inf")), {}
    for _ in range(TIMED_RUNS):
        for name, kernel in kernels.items():
            started = time.perf_counter()
            outputs[name] = kernel()
            best[name] = min(best[name], time.perf_counter() - started)
    choice = min(best, key=best.get)
    return choice, outputs[choice]
