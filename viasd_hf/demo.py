"""``viasd demo``: VIA-SD on a built-in model pair next to plain greedy, measured in the same run."""

from __future__ import annotations

import time

import torch
from torch import nn

from .architectures import num_decoder_layers, protected_layers
from .config import ViaSDConfig
from .generation import enable_viasd
from .masks import RoutingMask, RoutingMaskError
from .models import load_pretrained

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
SMALL_TARGET = "smollm2-135m-instruct"


def light_middle_mask(model: nn.Module, budget: float = 0.1) -> list[int]:
    """Evenly spaced early-middle layers: the fallback when no searched mask exists for a pair.

    DESIGN §9: on the 1.5B target, single layers in the first half cost least when skipped.
    """
    count = num_decoder_layers(model)
    candidates = [layer for layer in range(2, count // 2 + 1) if layer not in protected_layers(model)]
    wanted = max(1, round(budget * count))
    step = len(candidates) / wanted
    return [candidates[int(i * step)] for i in range(wanted)]


def demo_mask(model: nn.Module, target: str, drafter: str) -> tuple[RoutingMask, str]:
    """The mask for the pair from the user cache or ``hub_masks/`` (no network), else a light fallback."""
    try:
        mask = RoutingMask.from_pretrained((target, drafter), local_files_only=True)
        mask.validate_for(model)
        return mask, f"searched mask for ({target}, {drafter})"
    except RoutingMaskError:
        mask = RoutingMask.from_model(model, skip=light_middle_mask(model), drafter_id=drafter)
        return mask, "fallback mask (no searched mask found for this pair; run `viasd search`)"


def _timed(generate) -> tuple[object, float]:
    started = time.perf_counter()
    output = generate()
    return output, time.perf_counter() - started


def run_demo(
    small: bool = False,
    target_name: str | None = None,
    drafter_name: str | None = None,
    prompt: str = "Write a Python function that reverses a string.",
    max_new_tokens: int = 64,
    dtype: str | None = None,
) -> None:
    target_name = target_name or (SMALL_TARGET if small else DEFAULT_TARGET)
    drafter_name = drafter_name or (None if small else DEFAULT_DRAFTER)
    dtype = dtype or ("float32" if small else "bfloat16")
    print(f"loading {target_name} ({dtype}) ...", flush=True)
    model, tokenizer = load_pretrained(target_name, dtype=dtype)
    enable_viasd(model)
    drafting: dict[str, object] = {"prompt_lookup_num_tokens": 5}
    if drafter_name:
        print(f"loading drafter {drafter_name} ({dtype}) ...", flush=True)
        drafting = {"assistant_model": load_pretrained(drafter_name, dtype=dtype)[0]}
    mask, provenance = demo_mask(model, target_name, drafter_name or "self")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    common = {"max_new_tokens": max_new_tokens, "do_sample": False}
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        greedy, greedy_seconds = _timed(lambda: model.generate(ids, **common))
        viasd, viasd_seconds = _timed(lambda: model.generate(
            ids, viasd_config=ViaSDConfig.paper(routing_mask=mask), return_dict_in_generate=True, **drafting, **common
        ))
    generated = viasd.sequences[0, ids.shape[1]:]
    reference = greedy[0, ids.shape[1]:]
    agreement = sum(int(a == b) for a, b in zip(generated.tolist(), reference.tolist())) / max(1, len(reference))
    print(tokenizer.decode(generated, skip_special_tokens=True))
    print(f"\n[mask] {provenance}: skips {mask.skipped_layers} of {mask.num_layers} layers ({mask.skip_ratio:.0%})")
    print(f"[viasd] {viasd.viasd_stats.summary()}")
    print(
        f"[speed] greedy {len(reference) / greedy_seconds:.2f} tokens/s, VIA-SD {len(generated) / viasd_seconds:.2f} "
        f"tokens/s: {greedy_seconds / viasd_seconds * len(generated) / max(1, len(reference)):.2f}x greedy "
        f"(same run); token agreement with greedy {agreement:.0%}"
    )
