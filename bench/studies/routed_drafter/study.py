"""Would a routed drafter pay? The 4-bit 0.5B drafter with some of its decoder layers skipped.

For each skip set: how often the drafter's argmax, teacher-forced on the target's greedy output,
is the target's token (a proxy for acceptance), and the median seconds of a one-token drafter
pass after 300 cached tokens, against the whole drafter. The LM head runs in full here, so a pass
costs more than in decoding (where the draft vocabulary's 32k rows run); the layers' share of a
pass is larger there.

    python bench/studies/routed_drafter/study.py
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.masks.layer_skipping import skipping
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = (("humaneval", 3), ("spec_bench", 1))  # spec_bench: the first of each task, 3 kept


def median_ms(work: Callable[[Any], Any], prepare: Callable[[], Any] = lambda: None, repeats: int = 15) -> float:
    """Median milliseconds of ``work(prepare())``, timing ``work`` only (``prepare`` makes a fresh cache, say)."""
    seconds = []
    for _ in range(repeats):
        prepared = prepare()
        started = time.perf_counter()
        work(prepared)
        seconds.append(time.perf_counter() - started)
    return 1000 * sorted(seconds)[repeats // 2]


def cached_context(model: torch.nn.Module, length: int = 300) -> tuple[torch.Tensor, Any]:
    """A random context of ``length`` tokens and ``model``'s cache of all of them but the last."""
    context = torch.randint(100, 20000, (1, length))
    return context, model(context[:, :-1], use_cache=True).past_key_values


def pass_ms(model: torch.nn.Module) -> float:
    """Median milliseconds of a one-token pass after 300 cached tokens."""
    context, cache = cached_context(model)
    return median_ms(lambda fresh: model(context[:, -1:], past_key_values=fresh, use_cache=True),
                     prepare=lambda: copy.deepcopy(cache), repeats=7)


def pass_pieces(model: torch.nn.Module, vocabulary_rows: int = 32768) -> None:
    """A one-token pass piece by piece: the decoder body, then the LM head on the draft vocabulary's rows and on all."""
    context, cache = cached_context(model)
    body = model.get_decoder()
    hidden = body(input_ids=context[:, -1:], past_key_values=copy.deepcopy(cache), use_cache=True).last_hidden_state[0]
    weight = model.get_output_embeddings().weight
    rows = weight[torch.linspace(0, weight.shape[0] - 1, vocabulary_rows).long()].contiguous()
    running = median_ms(lambda fresh: body(input_ids=context[:, -1:], past_key_values=fresh, use_cache=True),
                        prepare=lambda: copy.deepcopy(cache))
    print(f"body {running:.1f} ms · head {vocabulary_rows} rows {median_ms(lambda _: hidden @ rows.T):.1f} ms · "
          f"head all {weight.shape[0]} rows {median_ms(lambda _: hidden @ weight.T):.1f} ms")


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    target, tokenizer = load_pretrained(TARGET, dtype="bfloat16")
    drafter, _ = load_pretrained(DRAFTER, quantization="bnb-4bit")
    pass_pieces(drafter)
    continuations = []
    for dataset, limit in PROMPTS:
        for example in load_examples(dataset, limit)[:3]:
            ids = encode(tokenizer, example.prompt)
            continuations.append((dataset, ids.shape[1], target.generate(ids, max_new_tokens=96, do_sample=False)))
    layers = drafter.config.num_hidden_layers
    middle = layers // 2
    skip_sets = ([], [middle], [middle, middle + 1], [middle - 1, middle, middle + 1],
                 list(range(layers - 5, layers - 1)), list(range(4, layers - 2, 4)))
    whole = None
    for skipped in skip_sets:
        with skipping(drafter, skipped):
            matches: dict[str, list[int]] = {}
            for dataset, start, sequence in continuations:
                argmax = drafter(sequence).logits[0, start - 1 : -1].argmax(-1)
                counts = matches.setdefault(dataset, [0, 0])
                counts[0] += int((argmax == sequence[0, start:]).sum())
                counts[1] += sequence.shape[1] - start
            milliseconds = pass_ms(drafter)
        whole = whole or milliseconds
        rates = "  ".join(f"{dataset} match {kept / total:.3f}" for dataset, (kept, total) in matches.items())
        print(f"skip {str(skipped):22s} pass {milliseconds:5.1f} ms ({milliseconds / whole:.2f})  {rates}", flush=True)


if __name__ == "__main__":
    main()
