"""Where a batch's time goes: the target's prefill, a one-token batched pass, the drafter's read of the prompts
(bf16; its copy in the form VIA-SD drafts with here, bitsandbytes 4-bit on a Zen4,
torchao int4 on an AMX Xeon; and that copy's reader, the same weights dequantised, through which VIA-SD reads), then batched greedy
``generate`` against batched lossless VIA-SD on the same batch (seconds and ``viasd_stats``). The first HumanEval
prompts as one left-padded batch, torch's default threads:

    HF_HUB_OFFLINE=1 python bench/studies/batch_read/study.py [batch size, default 8] [new tokens, default 48]
"""

import sys
import time

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.batches import left_pad
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form, prompt_reader
from viasd_hf.models.loading import load_pretrained

torch.set_grad_enabled(False)
size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
target, tokenizer = load_pretrained("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
drafter, _ = load_pretrained("qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
enable_viasd(target)
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
ids, mask = left_pad([encode(tokenizer, e.prompt) for e in load_examples("humaneval", size)], pad)
copy = fastest_form(drafter, now=True)
forms = {"drafter bf16": drafter, "drafter as VIA-SD drafts": copy}
if prompt_reader(copy) is not None:
    forms["its reader"] = prompt_reader(copy)


def seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


print(f"batch {tuple(ids.shape)}, {new_tokens} new tokens a row, {torch.get_num_threads()} threads")
for round_ in range(2):  # the first round pays first-use costs; read the second
    cache = target(ids, attention_mask=mask, use_cache=True).past_key_values
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    step = seconds(lambda: target(ids[:, -1:], attention_mask=step_mask, cache=cache))
    print(f"round {round_}: target prefill {seconds(lambda: target(ids, attention_mask=mask)):.2f} s, "
          f"one-token batched pass {step:.3f} s, "
          + ", ".join(f"{name} read {seconds(lambda m=m: m.model(ids, attention_mask=mask)):.2f} s"
                      for name, m in forms.items()))
common = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
              return_dict_in_generate=True)
target.generate(ids, **(common | {"max_new_tokens": 4}))
target.generate(ids, **(common | {"max_new_tokens": 4}), assistant_model=drafter, viasd_config=ViaSDConfig())
for repeat in range(2):
    greedy = seconds(lambda: target.generate(ids, **common))
    out = {}
    viasd = seconds(lambda: out.update(v=target.generate(ids, **common, assistant_model=drafter,
                                                         viasd_config=ViaSDConfig())))
    stats = out["v"].viasd_stats
    print(f"repeat {repeat}: batched greedy {greedy:.1f} s, VIA-SD {viasd:.1f} s ({greedy / viasd:.2f}x); VIA-SD "
          f"seconds {({k: round(v, 2) for k, v in stats.seconds.items()})}, {stats.blocks} blocks, "
          f"{stats.plain_blocks} plain, {stats.drafter_forwards} drafter passes; {stats.speculation_verdict}")
