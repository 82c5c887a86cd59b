"""Prefill seconds of the target and the drafter (bf16, and the 4-bit scheme given) on one prompt per Spec-Bench task:
    python bench/studies/drafter_context/prefill.py [bnb-4bit]"""
import sys
import time

import torch

from viasd_hf.data.tasks import _spec_bench
from viasd_hf.models.loading import load_pretrained

torch.set_num_threads(1)
ex = _spec_bench(3)
tgt, tok = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype=torch.bfloat16)
drafts = {"bf16": load_pretrained("qwen2.5-coder-0.5b-instruct", dtype=torch.bfloat16)[0],
          "bnb-4bit": load_pretrained("qwen2.5-coder-0.5b-instruct", quantization=sys.argv[1] if len(sys.argv)>1 else "bnb-4bit")[0]}
def t(model, ids):
    best = 9e9
    for _ in range(2):
        s = time.perf_counter()
        with torch.no_grad(): model(ids, logits_to_keep=1)
        best = min(best, time.perf_counter() - s)
    return best
seen = set()
for e in ex:
    ids = tok.apply_chat_template([{"role": "user", "content": e.prompt}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    if e.task in seen: continue
    seen.add(e.task)
    row = f"{e.task:15s} {ids.shape[1]:5d} tok  target {t(tgt, ids):6.2f}s"
    for k, m in drafts.items():
        row += f"  {k} {t(m, ids):6.2f}s"
    print(row, flush=True)
