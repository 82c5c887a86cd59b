"""On a GPU, does VIA-SD's plain (one-token) pass cost what `generate`'s greedy pass costs?

Replayed traces recorded on an H200 with random-weight Qwen2.5-Coder shapes showed VIA-SD's plain
target passes taking longer than greedy `generate`'s at the same width and context. This builds the
1.5B target and 0.5B drafter from `bench/gpu_shapes/` with random weights on the device, decodes 48
tokens with greedy `generate` and with lossless VIA-SD (which, its drafts all wrong, decodes plainly),
and prints per decoded token: wall time, the target body's passes and their median seconds, and the
operators the profiler saw (count and host seconds), largest differences first.

    python bench/studies/gpu_plain_pass/study.py [--device cuda] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd  # noqa: E402
from viasd_hf.bench.pass_costs import build  # noqa: E402
from viasd_hf.bench.traces import PassRecorder  # noqa: E402

SHAPES = REPO / "bench" / "gpu_shapes"


def shape(name: str, dtype: str) -> dict:
    return {"config": json.loads((SHAPES / f"{name}.json").read_text()), "form": dtype}


def described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}{'' if value.is_contiguous() else ' strided'}"
    return type(value).__name__ if value is not None else "None"


def what_a_pass_feeds(target: torch.nn.Module, run) -> dict[str, str]:
    """The keyword arguments of the target's 10th forward in ``run()``, and what its first layer's SDPA call got."""
    seen: dict[str, str] = {}
    calls = {"forward": 0}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def hook(module, args, kwargs):
        calls["forward"] += 1
        if calls["forward"] == 10:
            seen.update({f"forward {key}": described(value) for key, value in kwargs.items()})
            seen.update({f"forward arg {i}": described(value) for i, value in enumerate(args)})

    def logged(module, query, key, value, attention_mask, *args, **kwargs):
        if calls["forward"] == 10 and "sdpa mask" not in seen:
            seen.update({"sdpa mask": described(attention_mask), "sdpa query": described(query),
                         "sdpa key": described(key), "sdpa kwargs": ", ".join(sorted(kwargs))})
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = logged
    try:
        run()
    finally:
        handle.remove()
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    target = enable_viasd(build(shape("qwen2.5-coder-1.5b", args.dtype), args.device))
    drafter = build(shape("qwen2.5-coder-0.5b", args.dtype), args.device)
    mask = RoutingMask.from_model(target, skip=[12, 13, 14, 15])
    ids = torch.randint(target.config.vocab_size, (1, 64), device=args.device)
    common = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "do_sample": False, "pad_token_id": 0}
    calls = {
        "greedy": {},
        "viasd_lossless": {"assistant_model": drafter, "viasd_config": ViaSDConfig(routing_mask=mask)},
        "viasd_no_drafter_probe": {"assistant_model": drafter,
                                   "viasd_config": ViaSDConfig(routing_mask=mask, use_slim=False)},
    }
    recorder = PassRecorder({"target": target, "drafter": drafter})
    operators: dict[str, Counter] = {}
    host: dict[str, Counter] = {}
    with recorder.recording():
        for name, extra in calls.items():
            for _ in range(2):  # warm-up, then the measured call
                target.generate(ids, **common, **extra)
            recorder.take()
            started = time.perf_counter()
            target.generate(ids, **common, **extra)
            wall = time.perf_counter() - started
            passes = recorder.take()
            ones = [p.seconds for p in passes if p.kind == "body" and p.model.startswith("target") and p.width == 1]
            print(f"{name}: {wall / args.tokens * 1e3:.2f} ms per token; target one-token passes {len(ones)}, median "
                  f"{statistics.median(ones) * 1e3:.2f} ms; all passes {sum(p.seconds for p in passes) / args.tokens * 1e3:.2f} "
                  f"ms per token", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                target.generate(ids, **common, **extra)
            operators[name] = Counter({e.key: e.count for e in profile.key_averages()})
            for key, value in what_a_pass_feeds(target, lambda: target.generate(ids, **common, **extra)).items():
                print(f"    {key}: {value}")
            host[name] = Counter({e.key: e.self_cpu_time_total for e in profile.key_averages()})
    base = "greedy"
    for name in calls:
        if name == base:
            continue
        print(f"\noperators per token, {name} − {base} (count; host ms), largest host-time differences first:")
        keys = set(operators[name]) | set(operators[base])
        rows = sorted(keys, key=lambda k: -(abs(host[name][k] - host[base][k])))
        for key in rows[:25]:
            print(f"  {key:48s} {(operators[name][key] - operators[base][key]) / args.tokens:+8.1f}  "
                  f"{(host[name][key] - host[base][key]) / args.tokens / 1e3:+7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
