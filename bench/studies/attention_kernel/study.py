"""How long a drafting or verifying pass takes with SDPA, with the model's eager attention, and with the kernel
``viasd_hf.engine.attention`` measures fastest (SDPA, eager, or SDPA over grouped queries), over KV caches of growing
length, for one sequence or a left-padded batch (bf16 target, the drafter in the format ``--quantize drafter=auto``
chose).

    python bench/studies/attention_kernel/study.py [--contexts 300,1000,2000] [--batch 1] [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

from viasd_hf.engine.attention import fastest_attention, forget_kernel_choices, kernel_choices
from viasd_hf.engine.kv_cache import crop_to, new_cache
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
KERNELS = ("sdpa", "eager", "measured")


def pass_ms(model: torch.nn.Module, context: int, batch: int, rows: int, kernel: str, repeats: int) -> float:
    """Median milliseconds of a pass over ``rows`` new tokens a row after ``context`` cached ones; in a batch, half the
    rows are a quarter shorter, left-padded as ``generate`` pads them."""
    model.set_attn_implementation("eager" if kernel == "eager" else "sdpa")
    generator = torch.Generator().manual_seed(context + rows)
    ids = torch.randint(100, 20000, (batch, context + rows), generator=generator)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[batch // 2 :, : context // 4] = 0
    cache = new_cache(model.config)
    seconds = []
    with torch.no_grad(), (fastest_attention([model]) if kernel == "measured" else nullcontext()):
        model(ids[:, :context], attention_mask=mask[:, :context], cache=cache, use_cache=True)
        for _ in range(repeats + 1):
            started = time.perf_counter()
            model(ids[:, context:], attention_mask=mask, cache=cache, use_cache=True)
            seconds.append(time.perf_counter() - started)
            crop_to(cache, context)
    model.set_attn_implementation("sdpa")
    return statistics.median(seconds[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="300,1000,2000")
    parser.add_argument("--batch", type=int, default=1, help="rows of the batch (left-padded where more than one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    models = {
        "drafter (auto format)": (load_pretrained(DRAFTER, quantization="auto", draft_for=TARGET)[0], (1,)),
        "target (bf16)": (load_pretrained(TARGET, dtype="bfloat16")[0], (1, 4, 8)),
    }
    print(f"batch of {arguments.batch}, {torch.get_num_threads()} threads")
    print("| model | cached tokens | rows | " + " | ".join(f"{kernel} ms" for kernel in KERNELS) + " | chosen |")
    print("|---" * (4 + len(KERNELS)) + "|")
    for label, (model, rows_list) in models.items():
        for context in map(int, arguments.contexts.split(",")):
            for rows in rows_list:
                forget_kernel_choices()
                times = [pass_ms(model, context, arguments.batch, rows, kernel, arguments.repeats) for kernel in KERNELS]
                chosen = ", ".join(sorted(set(kernel_choices().values())))
                print(f"| {label} | {context} | {rows} | " + " | ".join(f"{ms:.1f}" for ms in times) + f" | {chosen} |",
                      flush=True)


if __name__ == "__main__":
    main()
