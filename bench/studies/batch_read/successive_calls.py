"""What batched lossless VIA-SD does call after call at one batch size: the first call probes, later ones know.

The speculation switch is remembered per batch size. A batch size's first call starts plainly and probes
speculation after two blocks, which makes the drafter read every prompt first; a later call knows both regimes'
throughput, the read's price and what the last speculating call's tail lost (rows finishing apart), and decodes
plainly from the start where speculating cannot earn those back. Five calls of batched greedy ``generate`` and of
batched VIA-SD (``ViaSDConfig()``, the drafter in the form VIA-SD picks) take turns on one left-padded batch of
the first B prompts of a packaged set, after one short warm-up call each, as ``viasd bench --batch-size`` warms up:

    HF_HUB_OFFLINE=1 python bench/studies/batch_read/successive_calls.py [B] [DATASET] [MAX_NEW_TOKENS]
"""

import sys

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.batches import decoder, left_pad
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.models.loading import load_pretrained

size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
dataset = sys.argv[2] if len(sys.argv) > 2 else "gsm8k"
max_new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 48
CALLS = 5

target, tokenizer = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype="auto")
drafter, _ = load_pretrained("qwen2.5-coder-0.5b-instruct", dtype="auto")
fastest_form(drafter, now=True)  # the drafting copy made before the calls, as a bench makes it
enable_viasd(target)
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
eos = set(torch.as_tensor(target.generation_config.eos_token_id).flatten().tolist())
batch = left_pad([encode(tokenizer, example.prompt) for example in load_examples(dataset, size)], pad)
common = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad, "return_dict_in_generate": True}
greedy = decoder(target, common, eos, viasd_config=None)
viasd = decoder(target, common, eos, assistant_model=drafter, viasd_config=ViaSDConfig())
short = common | {"max_new_tokens": 8}
decoder(target, short, eos, viasd_config=None)(*batch)
decoder(target, short, eos, assistant_model=drafter, viasd_config=ViaSDConfig())(*batch)

print(f"B = {size}, {dataset}, {max_new_tokens} new tokens a row, {torch.get_num_threads()} threads")
print("| call | greedy s | VIA-SD s | × greedy | plain blocks | drafter s | rows left at blocks | verdict |")
print("|---:|---:|---:|---:|---:|---:|---|---|")
for call in range(1, CALLS + 1):
    rows, greedy_seconds, _ = greedy(*batch)
    greedy_rate = sum(map(len, rows)) / greedy_seconds  # every row's tokens to its EOS, as the bench counts them
    rows, seconds, stats = viasd(*batch)
    left = sorted(entry["block"] for entry in stats.rows_left)
    print(f"| {call} | {greedy_seconds:.2f} | {seconds:.2f} | {sum(map(len, rows)) / seconds / greedy_rate:.2f} | "
          f"{stats.plain_blocks}/{stats.blocks} | {stats.seconds['drafter']:.2f} | {left[0]}–{left[-1]} | "
          f"{stats.speculation_verdict} |")
