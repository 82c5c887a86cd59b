"""What carrying the prompt in the first block saves: lossless VIA-SD as it decodes now (the first block's full
pass processes the prompt, and the drafter's prefill gives its first draft token, as in HF assisted
generation) side by side with the way it decoded before (the full model and the drafter each prefilled
the prompt but its last token, which opened the first block: one more pass of each), and HF assisted
generation, on the same prompts in one process, interleaved. bf16 target, the drafter in the format
``--quantize drafter=auto`` chooses, one torch thread.

    python bench/studies/prompt_in_first_block/study.py [--datasets spec_bench,xsum] [--limit 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from viasd_hf.bench.methods import Method

from viasd_hf.bench.methods import MethodTable
from viasd_hf.bench.runner import run_methods
from viasd_hf.data.tasks import load_examples
from viasd_hf.engine.loop import ViaSDDecoder
from viasd_hf.drafters import AssistantDrafter
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def prefill_but_the_last_token(drafter: AssistantDrafter, ids: torch.Tensor) -> int:
    """The drafter's prefill before: the prompt but its last token, which its first drafting pass fed."""
    prompt = drafter._pending(ids)[:, :-1]
    if prompt.shape[1]:
        with torch.no_grad():
            drafter._forward(prompt)
    return 0


@contextmanager
def separate_prefills() -> Iterator[None]:
    """Decoding as before: both models prefill the prompt but its last token before the first block."""
    two_tier, prefill = ViaSDDecoder.first_block_is_two_tier, AssistantDrafter.prefill
    ViaSDDecoder.first_block_is_two_tier = lambda self: False
    AssistantDrafter.prefill = prefill_but_the_last_token
    try:
        yield
    finally:
        ViaSDDecoder.first_block_is_two_tier, AssistantDrafter.prefill = two_tier, prefill


def with_separate_prefills(method: Method) -> Method:
    def run(ids, common):
        with separate_prefills():
            return method(ids, common)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="spec_bench,xsum")
    parser.add_argument("--limit", type=int, default=2, help="examples per task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, quantization="auto", draft_for=TARGET)
    mask = RoutingMask.from_pretrained((TARGET, DRAFTER), local_files_only=True)
    built = MethodTable(target, drafter, mask, None).build(["greedy", "hf_assisted", "viasd_lossless"])
    methods = {"hf_assisted": built["hf_assisted"], "lossless": built["viasd_lossless"],
               "lossless_separate_prefills": with_separate_prefills(built["viasd_lossless"])}
    examples = [e for dataset in args.datasets.split(",") for e in load_examples(dataset, args.limit)]
    runs = run_methods(methods, tokenizer, examples, args.max_new_tokens, args.repeats)
    rows = {name: {"tokens_per_s": [r.tokens_per_s(i) for i in range(len(examples))],
                   "tokens": [len(o.tokens) for o in r.outcomes]} for name, r in runs.items()}
    now, before, hf = (rows[name]["tokens_per_s"] for name in ("lossless", "lossless_separate_prefills", "hf_assisted"))
    gains = [a / b for a, b in zip(now, before)]
    print(f"{'task':22s} {'tokens':>6s} {'now × before':>13s} {'now × hf':>9s} {'before × hf':>12s}")
    for example, gain, a, b, h, tokens in zip(examples, gains, now, before, hf, rows["lossless"]["tokens"]):
        print(f"{example.task:22s} {tokens:6d} {gain:13.3f} {a / h:9.2f} {b / h:12.2f}")
    print(f"median: now × before {statistics.median(gains):.3f}, now × hf {statistics.median(a / h for a, h in zip(now, hf)):.2f}, "
          f"before × hf {statistics.median(b / h for b, h in zip(before, hf)):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": vars(args), "tasks": [e.task for e in examples], "methods": rows}, f, indent=2)


if __name__ == "__main__":
    main()
