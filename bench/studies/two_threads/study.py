"""Two cores: give each pass both threads, or run the drafter and the target side by side on one thread each
(parallel drafting, as PEARL does)? Times one target pass (1 and 5 tokens) and one drafter pass (one token)
after 300 cached, with one and two intra-op threads, then the target and drafter concurrently in two Python
threads of one torch thread each. The raw models with their own heads and attention; bf16 target, 4-bit drafter.

    python bench/studies/two_threads/study.py
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from viasd_hf.engine.kv_cache import new_cache
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


class Pass:
    """One model with a 300-token cache; each timed pass is rolled back so the cache stays at 300."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = new_cache(model.config)
        with torch.inference_mode():
            model(torch.randint(100, 20000, (1, 300)), past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def median_ms(self, tokens: int, passes: int) -> float:
        seconds = []
        for _ in range(passes):
            started = time.perf_counter()
            self.model(torch.full((1, tokens), 123), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            seconds.append(time.perf_counter() - started)
            self.cache.crop(-tokens)
        return 1000 * statistics.median(seconds)


def main() -> None:
    target = Pass(load_pretrained(TARGET, dtype=torch.bfloat16)[0])
    drafter = Pass(load_pretrained(DRAFTER, quantization="bnb-4bit")[0])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"{threads} intra-op threads: target 1 token {target.median_ms(1, 8):.0f} ms, 5 tokens "
              f"{target.median_ms(5, 8):.0f} ms; drafter 1 token {drafter.median_ms(1, 20):.0f} ms")
    torch.set_num_threads(1)
    side_by_side: dict[str, float] = {}
    runs = [threading.Thread(target=lambda: side_by_side.update(target=target.median_ms(5, 8))),
            threading.Thread(target=lambda: side_by_side.update(drafter=drafter.median_ms(1, 40)))]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    print(f"side by side, one thread each: target 5 tokens {side_by_side['target']:.0f} ms, "
          f"drafter 1 token {side_by_side['drafter']:.0f} ms")


if __name__ == "__main__":
    main()
