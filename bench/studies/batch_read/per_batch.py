"""Where batched lossless VIA-SD gains and where it does not, batch by batch: each left-padded batch of B prompts of a
packaged set, decoded by batched greedy ``generate``, by batched VIA-SD as configured (``ViaSDConfig()``) and by
batched VIA-SD speculating on every block (``reproducible=True``: nothing timed steers it), each once, after one short warm-up call each;
per batch the prompts' lengths, each method's seconds and × greedy, and VIA-SD's plain blocks and verdict:

    HF_HUB_OFFLINE=1 python bench/studies/batch_read/per_batch.py [B] [DATASET] [LIMIT] [MAX_NEW_TOKENS]

(``LIMIT`` as ``viasd bench --limit``: prompts per task where the set has tasks, as Spec-Bench does.)
"""

import sys

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.batches import decoder, left_pad
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.models.loading import load_pretrained

size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dataset = sys.argv[2] if len(sys.argv) > 2 else "spec_bench"
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 2
max_new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128

target, tokenizer = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype="auto")
drafter, _ = load_pretrained("qwen2.5-coder-0.5b-instruct", dtype="auto")
fastest_form(drafter, now=True)  # the drafting copy made before the calls, as a bench makes it
enable_viasd(target)
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
eos = set(torch.as_tensor(target.generation_config.eos_token_id).flatten().tolist())
prompts = [encode(tokenizer, example.prompt) for example in load_examples(dataset, limit)]
common = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad, "return_dict_in_generate": True}
configs = {"VIA-SD": ViaSDConfig(), "VIA-SD, every block": ViaSDConfig(reproducible=True)}
greedy = decoder(target, common, eos, viasd_config=None)
methods = {name: decoder(target, common, eos, assistant_model=drafter, viasd_config=config)
           for name, config in configs.items()}
short = common | {"max_new_tokens": 8}
first = left_pad(prompts[:size], pad)
decoder(target, short, eos, viasd_config=None)(*first)
for config in configs.values():
    decoder(target, short, eos, assistant_model=drafter, viasd_config=config)(*first)

print(f"B = {size}, {dataset} ×{len(prompts)}, {max_new_tokens} new tokens a row, {torch.get_num_threads()} threads")
print("| batch | prompt tokens | greedy s | " + " | ".join(f"{name} s (× greedy)" for name in methods)
      + " | VIA-SD plain blocks | VIA-SD verdict |")
print("|---" * (5 + len(methods)) + "|")
for start in range(0, len(prompts), size):
    batch = left_pad(prompts[start : start + size], pad)
    rows, greedy_seconds, _ = greedy(*batch)
    greedy_rate = sum(map(len, rows)) / greedy_seconds
    cells, default_stats = [], None
    for name, decode in methods.items():
        rows, seconds, stats = decode(*batch)
        cells.append(f"{seconds:.2f} ({sum(map(len, rows)) / seconds / greedy_rate:.2f})")
        default_stats = default_stats or stats
    lengths = ", ".join(str(ids.shape[1]) for ids in prompts[start : start + size])
    print(f"| {start // size} | {lengths} | {greedy_seconds:.2f} | " + " | ".join(cells)
          + f" | {default_stats.plain_blocks}/{default_stats.blocks} | {default_stats.speculation_verdict} |", flush=True)
