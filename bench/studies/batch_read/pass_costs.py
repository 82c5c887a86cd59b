"""What one pass costs as the batch grows: why speculation stops paying at some batch size.

A block's verify pass carries B·(k+1) tokens and its drafting passes B tokens each (the first one more: what
each row committed since its last draft). For B = 1, 4, 8 rows, each after 160 cached tokens, the median of
five passes over 1 and over 4 new tokens a row, for the Qwen2.5-Coder 1.5B target (bf16), its 0.5B drafter
(bf16), the drafter's copy in the form VIA-SD drafts with here, and that copy's twin (the same
weights dequantised, ``models/quantization/reader.py``), with torch's default threads:

    HF_HUB_OFFLINE=1 python bench/studies/batch_read/pass_costs.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

from viasd_hf.drafters.precision import drafting_reader, fastest_form
from viasd_hf.models.loading import load_pretrained

torch.set_grad_enabled(False)
CACHED, REPEATS = 160, 5
target, _ = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
drafter, _ = load_pretrained("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
copy = fastest_form(drafter, now=True)
forms = {"target bf16": target, "drafter bf16": drafter}
if copy is not drafter:
    forms["drafter as VIA-SD drafts"] = copy
reader = drafting_reader(copy)
if reader is not None:
    forms["its twin"] = reader.twin
    print(f"the twin runs drafting passes from {reader.from_tokens} tokens (measured when it was made)")


def pass_ms(model: torch.nn.Module, rows: int, new: int) -> float:
    """A pass over ``new`` tokens a row after ``CACHED`` cached ones, in milliseconds (the median of ``REPEATS``)."""
    generator = torch.Generator().manual_seed(rows)
    cache = DynamicCache(config=model.config)
    model(torch.randint(100, 5000, (rows, CACHED), generator=generator), cache=cache, use_cache=True)
    fed = torch.randint(100, 5000, (rows, new), generator=generator)
    times = []
    for _ in range(REPEATS + 1):  # the first pass of a shape pays the kernels' setup
        started = time.perf_counter()
        model(fed, cache=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - started)
        cache.crop(-new)
    return 1000 * statistics.median(times[1:])


print(f"{torch.get_num_threads()} threads; milliseconds a pass, after {CACHED} cached tokens a row")
print("| model | " + " | ".join(f"B={rows}, {new} new" for rows in (1, 4, 8) for new in (1, 4)) + " |")
for name, model in forms.items():
    print(f"| {name} | " + " | ".join(f"{pass_ms(model, rows, new):.0f}" for rows in (1, 4, 8) for new in (1, 4)) + " |")
