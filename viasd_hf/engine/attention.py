"""Short-query attention through whichever kernel is measured fastest on this machine: SDPA, the model's eager one, or
SDPA over grouped queries.

PyTorch's CPU SDPA kernel is built for long query blocks. For the 1–30 query rows of a drafting or
verifying pass over a long KV cache it can be far slower than the plain matmul–softmax–matmul of
the model's own eager attention, and drafting and verifying are nearly all such passes (timings:
``bench/studies/attention_kernel``, and docs/results.md).

Where query heads share key/value heads (grouped-query attention) and a pass has a mask and several
query rows (every verifying pass, and every pass over a padded batch), transformers copies each
key/value head once per query head that reads it (``repeat_kv``) before either kernel runs: the whole
cache, copied in every layer of every pass. The third kernel (``_grouped_sdpa``) folds the query
heads that share a key/value head into that head's query rows, so SDPA reads the cache as it is:
the same sums, none of the copies (timings: ``bench/studies/attention_kernel``, and docs/results.md,
"Batches: grouped-query attention").

Which kernel wins depends on the CPU, dtype and shapes, so it is measured, not assumed: the first
call of each shape bucket (``Bucket``) runs every kernel that computes the call on its real inputs
and the fastest one is remembered for the process (``kernel_choices``), as
``torch.backends.cudnn.benchmark`` does on GPUs.

How calls are steered, replacing nothing of transformers': the steering function is registered once,
at import, under an attention implementation name of its own (``STEERED``, through transformers'
public ``AttentionInterface.register``, and ``AttentionMaskInterface.register`` so that masks are made
for it as for SDPA): new keys, added beside transformers' own, which stay as they are. A call inside
``fastest_attention(models)`` switches each of its models' configs (the top config, its sub-configs,
any submodel's own) that is configured for ``"sdpa"`` to ``STEERED``, and the last concurrent call
on a config switches it back to ``"sdpa"`` when it returns, after an exception too. Only calls made
inside the context (this thread or task: a ``ContextVar``) are steered, and only on CPU; the steering
function runs plain SDPA for every other call, so plain ``generate`` in another thread on a model
that a steered call has switched computes exactly what it computes unswitched. A model whose code
reads the implementation's name other than through ``ALL_ATTENTION_FUNCTIONS`` (it compares it with
``"sdpa"``, or keeps an ``AttentionInterface`` of its own) is not switched, nor is one off the CPU.

Both kernels compute the same attention; they round differently (in bf16 visibly), so the choice
is left to measurement only where timings may steer the output (``tier_controller.measures_wall_clock``), and never
in a call on a sharded model, whose ranks must compute the same drafts (``_sharded``).
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from viasd_hf.engine.shards import shards_of

STEERED = "viasd_fastest"  # the attention implementation a steered call's models run: SDPA, or a kernel measured faster
LONGEST_QUERY = 64  # query rows beyond this are a prefill: SDPA's own ground
TIMED_RUNS = 3  # runs of each kernel, interleaved, when a bucket is first met; the fastest run counts

_STEERED: ContextVar[bool] = ContextVar("viasd_fastest_attention", default=False)
_LOCK = threading.Lock()
_switched: dict[int, list] = {}  # id(config) -> [config, calls inside the context that use it], while switched
_choices: dict[Bucket, str] = {}
# code that tells SDPA from other implementations by name, and a module's own attention class
_COMPARES_WITH_SDPA = re.compile(
    r"""(==|!=)\s*["']sdpa["']|["']sdpa["']\s*(==|!=|\bin\b)|\bin\s*[(\[{][^)\]}]*["']sdpa["']""")
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
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
def fastest_attention(models: Iterable[nn.Module | None], enabled: bool = True) -> Iterator[None]:
    """Within this context (this thread or task only), short-query attention of ``models`` (``None`` entries and
    repeats are ignored) runs the kernel measured fastest; each model's attention implementation is as it was after
    it, also after an exception. A call with a sharded model (``_sharded``) runs SDPA throughout."""
    models = _distinct(models)
    if not enabled or _sharded(models):
        yield
        return
    configs = _switch(models)
    token = _STEERED.set(True)
    try:
        yield
    finally:
        _STEERED.reset(token)
        _switch_back(configs)


def _sharded(models: list[nn.Module]) -> bool:
    """Whether a model is sharded over ranks (``engine.shards``). Every rank must then compute the same drafts, and a
    kernel timed on each rank may be chosen differently on each, rounding differently; rank 0 cannot choose for all
    either, since the choice is taken inside a pass, per bucket, and remembered for the process (an unsharded call
    timed on one rank alone would leave the ranks of the next sharded call waiting for each other). So the kernel is not
    timed: SDPA, as the sharded model's own ``generate`` runs; off the CPU, where sharding pays, nothing is steered
    anyway."""
    return any(shards_of(model) is not None for model in models)


def _switch(models: Iterable[nn.Module | None]) -> list[PretrainedConfig]:
    """Switch the SDPA configs of ``models`` that may be steered to ``STEERED`` (those another call switched stay so,
    one more call counted on them); the configs counted."""
    steerable = {id(config): config
                 for model in _distinct(models) if _may_steer(model) for config in _configs_of(model)}
    counted = []
    with _LOCK:
        try:
            for config in steerable.values():
                entry = _switched.get(id(config))
                if entry is not None:
                    entry[1] += 1
                elif config._attn_implementation == "sdpa":
                    _set_own_implementation(config, STEERED)
                    _switched[id(config)] = [config, 1]
                else:
                    continue
                counted.append(config)
        except BaseException:
            _release(counted)
            raise
    return counted


def _switch_back(configs: list[PretrainedConfig]) -> None:
    with _LOCK:
        _release(configs)


def _release(configs: list[PretrainedConfig]) -> None:
    """One call fewer on each of ``configs`` (under ``_LOCK``): the last one back to SDPA, unless something else set
    another implementation meanwhile."""
    for config in configs:
        entry = _switched[id(config)]
        entry[1] -= 1
        if entry[1] == 0:
            del _switched[id(config)]
            if config._attn_implementation == STEERED:
                _set_own_implementation(config, "sdpa")


def _distinct(models: Iterable[nn.Module | None]) -> list[nn.Module]:
    distinct: dict[int, nn.Module] = {}
    for model in models:
        if isinstance(model, nn.Module):
            distinct.setdefault(id(model), model)
    return list(distinct.values())


def _configs_of(model: nn.Module) -> list[PretrainedConfig]:
    """Every config the modules of ``model`` may read their attention implementation from: each module's own (a
    submodel may hold a copy) and the sub-configs of each (a composite model's ``text_config``...), at any depth."""
    found: dict[int, PretrainedConfig] = {}
    pending = [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if isinstance(config, PretrainedConfig) and id(config) not in found:
            found[id(config)] = config
            pending.extend(getattr(config, key, None) for key in config.sub_configs)
    return list(found.values())


def _implementations(config: PretrainedConfig) -> dict[str, Any]:
    """The attention implementation of ``config`` and of its sub-configs, nested, as ``_attn_implementation`` takes
    them."""
    tree: dict[str, Any] = {"": config._attn_implementation}
    for key in config.sub_configs:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            tree[key] = _implementations(sub)
    return tree


def _set_own_implementation(config: PretrainedConfig, implementation: str) -> None:
    """``config``'s own attention implementation, its sub-configs' as they are (the setter passes a name on to every
    sub-config, and a nested dict to each its own)."""
    config._attn_implementation = {**_implementations(config), "": implementation}


def _may_steer(model: nn.Module) -> bool:
    """Whether ``model`` is on the CPU and its code finds its attention by the implementation's name in
    ``ALL_ATTENTION_FUNCTIONS`` only, so that ``STEERED`` computes for it what ``"sdpa"`` computes."""
    device = getattr(model, "device", None)
    if not isinstance(device, torch.device) or device.type != "cpu":
        return False
    return all(_reads_implementation_by_interface(name) for name in
               {type(module).__module__ for module in model.modules()} if not name.startswith("torch."))


@cache
def _reads_implementation_by_interface(module_name: str) -> bool:
    """Whether the code of ``module_name`` finds attention by the implementation's name through the global
    ``ALL_ATTENTION_FUNCTIONS`` only: it compares nothing with ``"sdpa"`` (as ``config._attn_implementation in
    ("eager", "sdpa")`` does), keeps no ``AttentionInterface`` of its own (whose own entries are not ours), and its
    attention classes, if any, dispatch through the interface. Code that cannot be read: no."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    if "AttentionInterface()" in source or _COMPARES_WITH_SDPA.search(source):
        return False
    return not _ATTENTION_CLASS.search(source) or "ALL_ATTENTION_FUNCTIONS" in source


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    """Plain SDPA: whatever ``ALL_ATTENTION_FUNCTIONS`` holds under ``"sdpa"`` now (transformers' own, or a user's)."""
    return ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def _sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """SDPA's attention mask, made for ``STEERED`` models: whatever ``ALL_MASK_ATTENTION_FUNCTIONS`` holds under
    ``"sdpa"``."""
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def _steered_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """SDPA, unless this call is steered and another kernel that computes it is measured faster for its bucket."""
    kernels = _kernels(module, query, key, value, attention_mask, args, kwargs) if _STEERED.get() else {}
    if not kernels:
        return _sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    kernels["sdpa"] = lambda: _sdpa(module, query, key, value, attention_mask, **kwargs)
    bucket = Bucket.of(module, query, key)
    with _LOCK:
        choice = _choices.get(bucket)
    if choice is None:
        choice, output = _measure(kernels)
        with _LOCK:
            _choices.setdefault(bucket, choice)
        return output
    return kernels[choice]()


AttentionInterface.register(STEERED, _steered_sdpa)  # new keys beside transformers' own, which stay as they are
AttentionMaskInterface.register(STEERED, _sdpa_mask)


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
