"""Does verifying the drafter's second choices beside the draft pay in decoding? Lossless VIA-SD with and without them,
and greedy ``generate``, interleaved prompt by prompt in one process (``ViaSDConfig()``, the built-in pair, the
drafting copy made before timing, as ``viasd bench`` makes it).

    HF_HUB_OFFLINE=1 python bench/studies/draft_trees/second_choices.py [--datasets spec_bench,wmt14] [--limit 2]
        [--repeats 2] [--max-new-tokens 128]

Prints, per task, the median over prompts of each method's tokens per second over greedy's, and the second choices
verified and kept.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import viasd_hf.engine.batch.loop as loop
from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
VERIFIES_BESIDE = loop.verifies_beside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--datasets", default="spec_bench,wmt14")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, dtype=torch.bfloat16)
    fastest_form(drafter, now=True)
    enable_viasd(target)
    examples = [example for dataset in args.datasets.split(",") for example in load_examples(dataset, args.limit)]

    def timed(ids: torch.Tensor, method: str) -> tuple[float, object]:
        loop.verifies_beside = VERIFIES_BESIDE if method == "with" else (lambda *_, **__: False)
        kwargs = {} if method == "greedy" else {"assistant_model": drafter, "viasd_config": ViaSDConfig()}
        started = time.perf_counter()
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True,
                              **kwargs)
        return (out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - started), out

    timed(encode(tokenizer, examples[0].prompt), "with")  # warm-up: the first call measures its passes' shapes
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for example in examples:
        ids = encode(tokenizer, example.prompt)
        speeds: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):
            for method in ("greedy", "with", "without"):
                speed, out = timed(ids, method)
                speeds[method].append(speed)
                if method == "with":
                    counts[example.task][0] += out.viasd_stats.second_choices
                    counts[example.task][1] += out.viasd_stats.second_choices_kept
        greedy = statistics.median(speeds["greedy"])
        for method in ("with", "without"):
            ratios[example.task][method].append(statistics.median(speeds[method]) / greedy)
    print(f"{torch.get_num_threads()} threads; x greedy, median over prompts")
    print("| task | prompts | with second choices | without | second choices kept |")
    print("|---|---:|---:|---:|---:|")
    for task, methods in ratios.items():
        fed, kept = counts[task]
        print(f"| {task} | {len(methods['with'])} | {statistics.median(methods['with']):.2f} | "
              f"{statistics.median(methods['without']):.2f} | {kept} of {fed} |")


if __name__ == "__main__":
    main()
