"""What a process's first VIA-SD call costs: a fresh process loads the built-in pair, calls ``generate`` with
``ViaSDConfig()`` ``CALLS`` times on the first Spec-Bench prompt of ``TASK``, then once plainly, and prints each call's
seconds, greedy's, and whether the drafter's drafting copy was made (``drafters.precision.making_pays``). Run it once per
process: the first call is what it measures.

    HF_HUB_OFFLINE=1 python bench/studies/first_call/study.py qa 6
"""

from __future__ import annotations

import sys
import time

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import drafting_copy
from viasd_hf.models.loading import load_pretrained


def seconds(call) -> tuple[float, object]:
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def main() -> None:
    task, calls = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else ("qa", 6)
    target, tokenizer = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16)
    drafter, _ = load_pretrained("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16)
    enable_viasd(target)
    ids = encode(tokenizer, next(e for e in load_examples("spec_bench", 1) if e.task == task).prompt)
    timed = [seconds(lambda: target.generate(ids, assistant_model=drafter, viasd_config=ViaSDConfig(),
                                             max_new_tokens=128, do_sample=False)) for _ in range(calls)]
    greedy, expected = seconds(lambda: target.generate(ids, max_new_tokens=128, do_sample=False))
    print(f"{task}: VIA-SD calls {' '.join(f'{s:.2f}' for s, _ in timed)} s; greedy {greedy:.2f} s; first call "
          f"{greedy / timed[0][0]:.2f}x greedy; copy made: {drafting_copy(drafter) is not None}; "
          f"outputs as greedy's: {all(torch.equal(out, expected) for _, out in timed)}")


if __name__ == "__main__":
    main()
