"""Where a drafter pass's time goes: one token after 300 cached, the 4-bit drafter's body on eager attention
(as our decoders run it on this CPU), 10 passes under ``torch.profiler``, the top operators by own time.

    python bench/studies/compiled_drafter/profile_pass.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from viasd_hf.engine.kv_cache import new_cache
from viasd_hf.models.loading import load_pretrained

DRAFTER = "qwen2.5-coder-0.5b-instruct"


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(1)
    drafter, _ = load_pretrained(DRAFTER, quantization="bnb-4bit", attn_implementation="eager")
    body = drafter.get_decoder()
    cache = new_cache(drafter.config)
    body(input_ids=torch.randint(100, 20000, (1, 300)), past_key_values=cache, use_cache=True)

    def one_pass() -> None:
        body(input_ids=torch.tensor([[123]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)

    for _ in range(5):
        one_pass()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(10):
            one_pass()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
