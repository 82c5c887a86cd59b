"""Does batched lossless VIA-SD beat batched greedy ``generate``, and by how much at batch sizes 1, 2 and 4?

The Qwen2.5-Coder 1.5B target with its 0.5B drafter, both bf16, torch's default threads, the first
prompts of Spec-Bench (one per task), 32 new tokens. For each batch size the prompts are split into
batches in order, each batch left-padded and decoded by plain greedy ``generate`` and by VIA-SD
(``ViaSDConfig`` with the pair's routing mask, everything else its default: the slim tier, draft
lengths and the fall-back to plain decoding all measured online), the two interleaved ``--repeats``
times on each batch and each timed by its median. Tokens per second count every row's new tokens up
to its EOS over the wall time of the whole call, prefill included. Lossless VIA-SD gives greedy's
tokens up to bf16 rounding (a batched pass over several tokens rounds differently from one-token
steps), so the rows found identical are reported. Batch size 1 is the single-sequence path.

    python bench/studies/batch/study.py [--prompts 4] [--max-new-tokens 32] [--batch-sizes 1,2,4] [--repeats 3]
                                        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.data.tasks import load_examples
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def encode(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False) for text in texts]
    return tokenizer(chats, return_tensors="pt", padding=True)


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Each row's new tokens up to and including its first EOS (what follows is padding)."""
    count = 0
    for row in sequences[:, prompt_width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        count += ends[0] + 1 if ends else len(row)
    return count


def timed(target, batch, max_new_tokens: int, **kwargs) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    out = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3, help="greedy and VIA-SD, interleaved, per batch")
    parser.add_argument("--json")
    args = parser.parse_args()
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, dtype=torch.bfloat16)
    tokenizer.padding_side = "left"
    enable_viasd(target)
    mask = RoutingMask.from_pretrained((TARGET, DRAFTER), local_files_only=True)
    config = ViaSDConfig(routing_mask=mask, drafter_precision="as_loaded")
    eos = set(torch.as_tensor(target.generation_config.eos_token_id).flatten().tolist())
    texts = [example.prompt for example in load_examples("spec_bench", limit=1)][: args.prompts]
    warm = encode(tokenizer, ["Say hi.", "Name a colour."])
    timed(target, warm, 8, viasd_config=None)
    timed(target, warm, 8, assistant_model=drafter, viasd_config=config)
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    rows = []
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        totals, same = {"greedy": [0, 0.0], "viasd": [0, 0.0]}, 0
        for start in range(0, len(texts), size):
            batch = encode(tokenizer, texts[start : start + size])
            width = batch["input_ids"].shape[1]
            plain_times, our_times = [], []
            for _ in range(args.repeats):
                plain, seconds = timed(target, batch, args.max_new_tokens, viasd_config=None)
                plain_times.append(seconds)
                ours, seconds = timed(target, batch, args.max_new_tokens, assistant_model=drafter, viasd_config=config)
                our_times.append(seconds)
            plain_seconds, our_seconds = statistics.median(plain_times), statistics.median(our_times)
            same += sum(bool(torch.equal(a, b)) for a, b in zip(plain, ours)) if plain.shape == ours.shape else 0
            tokens = new_tokens(ours, width, eos)
            totals["greedy"][0] += tokens
            totals["greedy"][1] += plain_seconds
            totals["viasd"][0] += tokens
            totals["viasd"][1] += our_seconds
        greedy, viasd = (totals[m][0] / totals[m][1] for m in ("greedy", "viasd"))
        rows.append({"batch_size": size, "tokens": totals["viasd"][0], "greedy_tokens_per_s": round(greedy, 2),
                     "viasd_tokens_per_s": round(viasd, 2), "viasd_over_greedy": round(viasd / greedy, 3),
                     "rows_identical": f"{same}/{len(texts)}"})
        print(rows[-1], flush=True)
        if args.json:  # after every batch size, so a run cut short keeps what it measured
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"machine": machine, "prompts": len(texts), "max_new_tokens": args.max_new_tokens,
                           "repeats": args.repeats, "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
