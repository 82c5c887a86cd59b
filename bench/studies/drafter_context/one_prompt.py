"""Lossless VIA-SD on one long summarisation prompt, the whole prompt against a 256-token drafter window:
    python bench/studies/drafter_context/one_prompt.py"""
import time

import torch

from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.models.loading import load_pretrained

torch.set_num_threads(1)
T, D = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
tgt, tok = load_pretrained(T, dtype=torch.bfloat16); enable_viasd(tgt)
dr, _ = load_pretrained(D, quantization="auto", draft_for=T)
mask = RoutingMask.from_pretrained((T, D), local_files_only=True)
e = [e for e in load_examples("spec_bench") if e.task == "summarization"][10]
ids = encode(tok, e.prompt)
for ctx in (None, 256, None, 256):
    cfg = ViaSDConfig(routing_mask=mask, mode="lossless", drafter_context=ctx)
    s = time.perf_counter()
    out = tgt.generate(ids, assistant_model=dr, viasd_config=cfg, max_new_tokens=64, do_sample=False, return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    print(ctx, f"{time.perf_counter()-s:.1f}s", out.viasd_stats.summary(), flush=True)
