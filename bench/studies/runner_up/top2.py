"""How often the drafter's first and second choices are the target's greedy token (12 held-out Spec-Bench prompts):
    python bench/studies/runner_up/top2.py"""
import collections

import torch

from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.models.loading import load_pretrained

torch.set_num_threads(1)
T, D = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
tgt, tok = load_pretrained(T, dtype=torch.bfloat16)
dr, _ = load_pretrained(D, quantization="auto", draft_for=T)
ex = load_examples("spec_bench")
by = collections.defaultdict(list)
for e in ex: by[e.task].append(e)
stats = collections.Counter(); conf_bins = collections.defaultdict(collections.Counter)
for task, es in by.items():
    for e in es[10:12]:
        ids = encode(tok, e.prompt)
        if ids.shape[1] > 400: ids = ids[:, -400:]
        with torch.no_grad():
            out = tgt.generate(ids, max_new_tokens=48, do_sample=False)
            logits = dr(out).logits[0, ids.shape[1]-1:-1].float()
        cont = out[0, ids.shape[1]:]
        p = logits.softmax(-1); top = p.topk(2, -1)
        for i, t in enumerate(cont.tolist()):
            c = top.values[i, 0].item(); b = min(int(c * 5), 4)
            hit1 = top.indices[i, 0].item() == t; hit2 = top.indices[i, 1].item() == t
            stats["n"] += 1; stats["top1"] += hit1; stats["miss"] += not hit1; stats["top2|miss"] += (not hit1) and hit2
            conf_bins[b]["n"] += 1; conf_bins[b]["miss"] += not hit1; conf_bins[b]["top2|miss"] += (not hit1) and hit2
        print(task, dict(stats), flush=True)
print("top1", stats["top1"]/stats["n"], "top2|miss", stats["top2|miss"]/stats["miss"])
for b in sorted(conf_bins):
    c = conf_bins[b]; print(f"conf [{b/5:.1f},{(b+1)/5:.1f}) n {c['n']} miss {c['miss']/c['n']:.2f} top2|miss {c['top2|miss']/max(1,c['miss']):.2f}")
