"""Would ``torch.compile`` make the drafter cheap enough to matter? The 4-bit drafter's body compiled
(inductor, dynamic shapes) for HF assisted generation and for lossless VIA-SD alike, side by side with
the same methods uncompiled, on the same prompts in one process, interleaved, after a warm-up that
pays the compilation. bf16 target, the drafter in the format ``--quantize drafter=auto`` chooses, one
torch thread.

    python bench/studies/compiled_drafter/study.py [--datasets spec_bench,humaneval] [--limit 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from viasd_hf.bench.methods import Method, MethodTable
from viasd_hf.bench.runner import run_methods
from viasd_hf.data.tasks import load_examples
from viasd_hf.engine.kv_cache import new_cache
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@torch.inference_mode()
def body_pass_ms(body: torch.nn.Module, config, context: int = 300, passes: int = 30) -> float:
    """Median time of a one-token pass of the drafter's body after ``context`` cached tokens (rolled back each time)."""
    cache = new_cache(config)
    body(input_ids=torch.randint(100, 20000, (1, context)), past_key_values=cache, use_cache=True)
    seconds = []
    for index in range(passes + 3):
        started = time.perf_counter()
        body(input_ids=torch.tensor([[123]]), past_key_values=cache, use_cache=True)
        if index >= 3:
            seconds.append(time.perf_counter() - started)
        cache.crop(-1)
    return 1000 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="spec_bench,humaneval")
    parser.add_argument("--limit", type=int, default=1, help="examples per task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, quantization="auto", draft_for=TARGET)
    mask = RoutingMask.from_pretrained((TARGET, DRAFTER), local_files_only=True)
    built = MethodTable(target, drafter, mask, None).build(["greedy", "hf_assisted", "viasd_lossless"])
    body = drafter.get_decoder()
    compiled_forward = torch.compile(body.forward, dynamic=True)

    @contextmanager
    def compiled() -> Iterator[None]:
        body.forward = compiled_forward  # an instance attribute: both decoders call the body through it
        try:
            yield
        finally:
            del body.forward

    def with_compiled(method: Method) -> Method:
        def run(ids, common):
            with compiled():
                return method(ids, common)
        return run

    methods = {"hf_assisted": built["hf_assisted"], "lossless": built["viasd_lossless"],
               "hf_assisted_compiled": with_compiled(built["hf_assisted"]),
               "lossless_compiled": with_compiled(built["viasd_lossless"])}
    eager_ms = body_pass_ms(body, drafter.config)
    with compiled():
        body_pass_ms(body, drafter.config, passes=1)  # compiles
        compiled_ms = body_pass_ms(body, drafter.config)
    print(f"drafter body, one token after 300: eager {eager_ms:.1f} ms, compiled {compiled_ms:.1f} ms")
    examples = [e for dataset in args.datasets.split(",") for e in load_examples(dataset, args.limit)]
    started = time.perf_counter()
    run_methods(methods, tokenizer, examples[:1], 32, 1)
    print(f"warm-up (compilation included): {time.perf_counter() - started:.0f} s")
    runs = run_methods(methods, tokenizer, examples, args.max_new_tokens, args.repeats)
    speed = {name: [r.tokens_per_s(i) for i in range(len(examples))] for name, r in runs.items()}

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(speed[a], speed[b])]

    columns = [("lossless_compiled", "lossless"), ("hf_assisted_compiled", "hf_assisted"),
               ("lossless", "hf_assisted"), ("lossless_compiled", "hf_assisted_compiled")]
    print(f"{'task':16s} {'tokens':>6s} " + " ".join(f"{a + ' ÷ ' + b:>44s}" for a, b in columns))
    for index, example in enumerate(examples):
        print(f"{example.task:16s} {len(runs['lossless'].outcomes[index].tokens):6d} "
              + " ".join(f"{ratios(a, b)[index]:44.3f}" for a, b in columns))
    print(f"{'median':23s} " + " ".join(f"{statistics.median(ratios(a, b)):44.3f}" for a, b in columns))


if __name__ == "__main__":
    main()
