"""What the target's read of a batch's prompts costs, padded to the longest as batched ``generate`` reads them, and
as the first pass of batched VIA-SD reads them (``RaggedCache.read``: one row a pass where the padding would cost
more than the extra passes). For each left-padded batch of B prompts of a packaged set, the prompts' lengths, the
columns each read computes and its seconds (the best of ``REPEATS`` reads), for the Qwen2.5-Coder 1.5B target as
``dtype="auto"`` loads it, with torch's default threads:

    HF_HUB_OFFLINE=1 python bench/studies/batch_read/target_read.py [B] [DATASET] [LIMIT]

(``LIMIT`` as ``viasd bench --limit``: prompts per task where the set has tasks, as Spec-Bench does.)
"""

import sys
import time

import torch

from viasd_hf.bench.batches import left_pad
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.models.loading import load_pretrained

torch.set_grad_enabled(False)
REPEATS = 2
size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dataset = sys.argv[2] if len(sys.argv) > 2 else "spec_bench"
limit = int(sys.argv[3]) if len(sys.argv) > 3 else 2

target, tokenizer = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype="auto")
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
prompts = [encode(tokenizer, example.prompt) for example in load_examples(dataset, limit)]


def padded(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """A read as ``generate``'s batched prefill makes it: every row to the longest's length."""
    target(ids, attention_mask=mask, logits_to_keep=1)
    return ids.numel()


def ragged(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """A read as batched VIA-SD's first pass makes it."""
    return RaggedCache(target.config, ids.shape[0], ids.device).read(target, ids, mask.bool(), keep=1)[1]


def best_seconds(read, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, float]:
    times, columns = [], 0
    for _ in range(REPEATS):
        started = time.perf_counter()
        columns = read(ids, mask)
        times.append(time.perf_counter() - started)
    return columns, min(times)


padded(*left_pad(prompts[:size], pad))  # warm-up
print(f"B = {size}, {dataset} ×{len(prompts)}, {torch.get_num_threads()} threads, target {target.dtype}")
print("| prompt tokens | padded: columns, s | VIA-SD's read: columns, s | padded ÷ VIA-SD's |")
print("|---|---:|---:|---:|")
for start in range(0, len(prompts), size):
    batch = left_pad(prompts[start : start + size], pad)
    (wide, slow), (narrow, fast) = best_seconds(padded, *batch), best_seconds(ragged, *batch)
    lengths = ", ".join(str(ids.shape[1]) for ids in prompts[start : start + size])
    print(f"| {lengths} | {wide}, {slow:.2f} | {narrow}, {fast:.2f} | {slow / fast:.2f} |", flush=True)
