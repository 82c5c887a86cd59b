"""How much of a long prompt the assistant drafter should read (``ViaSDConfig.drafter_context``): lossless VIA-SD
with the drafter reading the whole prompt and windows of it, side by side with HF assisted generation
on long prompts (Spec-Bench RAG and summarisation, XSum), bf16 target, the drafter in the format
``--quantize drafter=auto`` chooses, one torch thread.

The prompts are taken after the first ``--skip`` of each task, so that the window is not chosen on the
prompts ``viasd bench --limit 3`` reports.

    python bench/studies/drafter_context/study.py [--windows 128,256,512] [--per-task 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import islice

import torch

from viasd_hf.bench.methods import MethodSettings, MethodTable
from viasd_hf.bench.runner import run_methods
from viasd_hf.data.tasks import load_examples
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def long_prompts(per_task: int, skip: int) -> list:
    spec_bench = [e for e in load_examples("spec_bench") if e.task in ("rag", "summarization")]
    by_task = {task: [e for e in spec_bench if e.task == task] for task in ("rag", "summarization")}
    by_task["xsum"] = load_examples("xsum", skip + per_task)
    return [e for examples in by_task.values() for e in islice(examples, skip, skip + per_task)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="128,256,512")
    parser.add_argument("--per-task", type=int, default=3)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, quantization="auto", draft_for=TARGET)
    mask = RoutingMask.from_pretrained((TARGET, DRAFTER), local_files_only=True)
    windows = [None] + [int(w) for w in args.windows.split(",")]
    methods = {"hf_assisted": MethodTable(target, drafter, mask, None).build(["greedy", "hf_assisted"])["hf_assisted"]}
    for window in windows:
        table = MethodTable(target, drafter, mask, None, MethodSettings(drafter_context=window))
        methods[f"lossless_ctx{window}"] = table.build(["greedy", "viasd_lossless"])["viasd_lossless"]
    examples = long_prompts(args.per_task, args.skip)
    runs = run_methods(methods, tokenizer, examples, args.max_new_tokens, args.repeats)
    rows = {}
    for name, method_runs in runs.items():
        drafting = [(o.viasd or {}).get("seconds", {}).get("drafter", 0.0) for o in method_runs.outcomes]
        rows[name] = {
            "tokens_per_s": [method_runs.tokens_per_s(i) for i in range(len(examples))],
            "mean_accepted": sum(o.accepted or 0 for o in method_runs.outcomes) / max(1, sum(o.full_forwards for o in method_runs.outcomes)),
            "drafter_seconds": drafting,
        }
    whole = rows["lossless_ctxNone"]["tokens_per_s"]
    hf = rows["hf_assisted"]["tokens_per_s"]
    print(f"{'method':18s} {'× whole prompt':>15s} {'× hf_assisted':>14s}  per task (× whole prompt)")
    for name, row in rows.items():
        ratios = [a / b for a, b in zip(row["tokens_per_s"], whole)]
        against_hf = [a / b for a, b in zip(row["tokens_per_s"], hf)]
        tasks = {task: statistics.median(r for r, e in zip(ratios, examples) if e.task == task) for task in dict.fromkeys(e.task for e in examples)}
        print(f"{name:18s} {statistics.median(ratios):15.2f} {statistics.median(against_hf):14.2f}  "
              + " ".join(f"{task} {value:.2f}" for task, value in tasks.items()))
    if args.json:
        report = {"options": vars(args), "tasks": [e.task for e in examples], "methods": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
