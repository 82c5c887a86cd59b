"""``viasd demo``: generate with a built-in model and show how well its slim verifier agrees."""

from __future__ import annotations

import time

import torch

from .agreement import teacher_forced_agreement
from .architectures import num_decoder_layers, protected_layers
from .masks import RoutingMask
from .models import load_pretrained

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
SMALL_MODEL = "smollm2-135m-instruct"


def light_middle_mask(model: torch.nn.Module, budget: float = 0.1) -> list[int]:
    """Evenly spaced early-middle layers, a placeholder until DIMR-searched masks ship in ``hub_masks/``.

    DESIGN §9: on the 1.5B target, single layers in the first half cost least when skipped.
    """
    count = num_decoder_layers(model)
    candidates = [layer for layer in range(2, count // 2 + 1) if layer not in protected_layers(model)]
    wanted = max(1, round(budget * count))
    step = len(candidates) / wanted
    return [candidates[int(i * step)] for i in range(wanted)]


def run_demo(
    model_name: str | None = None,
    small: bool = False,
    prompt: str = "Write a Python function that reverses a string.",
    max_new_tokens: int = 48,
    skip: list[int] | None = None,
    dtype: str | None = None,
) -> None:
    name = model_name or (SMALL_MODEL if small else DEFAULT_MODEL)
    dtype = dtype or ("bfloat16" if name == DEFAULT_MODEL else "float32")
    print(f"loading {name} ({dtype}) ...", flush=True)
    model, tokenizer = load_pretrained(name, dtype=dtype)
    messages = [{"role": "user", "content": prompt}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

    started = time.perf_counter()
    with torch.no_grad():
        sequence = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - started
    new_tokens = sequence.shape[1] - input_ids.shape[1]
    print(tokenizer.decode(sequence[0, input_ids.shape[1]:], skip_special_tokens=True))
    print(f"\n[greedy] {new_tokens} tokens in {seconds:.1f}s ({new_tokens / seconds:.2f} tokens/s)")

    mask = RoutingMask.from_model(model, skip=skip or light_middle_mask(model))
    agreement = teacher_forced_agreement(model, mask, sequence, start=input_ids.shape[1])
    print(
        f"[slim verifier] skips layers {mask.skipped_layers} of {mask.num_layers} "
        f"({mask.skip_ratio:.0%}): top-1 agreement with the full model {agreement.top1:.1%}, "
        f"mean KL {agreement.kl:.3f} nats over {agreement.positions} positions"
    )
