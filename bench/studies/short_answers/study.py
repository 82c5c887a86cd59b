"""Why short answers stay below 1.6x greedy: per prompt, what lossless VIA-SD's own passes cost and keep, and how much
of the call no drafting can speed up.

Decodes each prompt (``viasd bench --dataset D --limit N``'s; by default the first prompt of each Spec-Bench task) with
``ViaSDConfig()`` and the bf16 pair, as a user would, three times (the first measures its passes' shapes), then twice
plainly; the faster of the last two calls and of greedy's two are compared. From that call's ``viasd_stats`` it prints
tokens per block, drafts per speculative block, the target's and the drafter's seconds per decoding pass (the passes
over the prompt left out), and their ratio c; α, how often the bf16 drafter's first choice is the output's next token
(teacher-forced on it; and how often one of its first three is), and the ceiling of chain drafting, max over k of
(1 + α + … + α^k) / (1 + k·c) (second choices verified beside the draft can pass it).

A call pays two passes once, whatever it drafts: the target's over the prompt, and the drafter's read of it (through its
drafting copy, or its twin from as many tokens as the decoder reads through it: ``reading_model``); both are timed
apart. What is left of each call is its decoding: greedy's seconds less the prompt pass, over VIA-SD's less both, is how
much faster VIA-SD decoded, and greedy's less the prompt pass over a 1.6x call's budget (greedy's seconds / 1.6) less
both is how fast decoding must run for the call to reach 1.6x greedy ("never" where the two passes alone exceed that
budget).

    HF_HUB_OFFLINE=1 python bench/studies/short_answers/study.py [DATASET [LIMIT]]
"""

from __future__ import annotations

import sys
import time

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import drafting_copy, drafting_reader, fastest_form
from viasd_hf.engine.batch.model_drafts import reading_model
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 128
TARGET_SPEEDUP = 1.6


def ceiling(kept: float, cost: float, longest: int = 16) -> float:
    """The best speed-up of chain drafting over plain decoding when each draft is kept with chance ``kept`` and a
    drafter pass costs ``cost`` of a verifying pass (verifying k + 1 tokens costing what one does)."""
    return max(sum(kept**j for j in range(k + 1)) / (1 + k * cost) for k in range(1, longest + 1))


def seconds(call) -> tuple[float, object]:
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def main() -> None:
    dataset = sys.argv[1] if len(sys.argv) > 1 else "spec_bench"
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, dtype=torch.bfloat16)
    fastest_form(drafter, now=True)  # the drafting copy made before the calls, as a bench makes it
    drafting = drafting_copy(drafter) or drafter
    enable_viasd(target)
    for example in load_examples(dataset, limit):
        ids = encode(tokenizer, example.prompt)
        calls = [seconds(lambda: target.generate(ids, assistant_model=drafter, viasd_config=ViaSDConfig(),
                                                 max_new_tokens=NEW_TOKENS, do_sample=False,
                                                 return_dict_in_generate=True)) for _ in range(3)]
        spent, out = min(calls[1:], key=lambda call: call[0])
        greedy = min(seconds(lambda: target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))[0]
                     for _ in range(2))
        with torch.no_grad():
            prompt_pass, _ = seconds(lambda: target(ids, logits_to_keep=1))
            reader = reading_model(drafting, drafting_reader(drafting), ids.shape[1])
            read, _ = seconds(lambda: reader(ids, logits_to_keep=1))
        stats = out.viasd_stats
        speculative = max(stats.blocks - stats.plain_blocks, 1)
        with torch.inference_mode():
            choices = drafter(out.sequences).logits[0, ids.shape[1] - 1 : -1].topk(3, dim=-1).indices
        matches = choices == out.sequences[0, ids.shape[1] :, None]
        kept, top3 = matches[:, 0].float().mean().item(), matches.any(-1).float().mean().item()
        full = max(stats.seconds["full"] - prompt_pass, 0.0) / max(stats.full_forwards - 1, 1)
        draft = max(stats.seconds["drafter"] - read, 0.0) / max(stats.drafter_forwards - 1, 1)
        decoding = max(greedy - prompt_pass, 0.0)
        budget = greedy / TARGET_SPEEDUP - prompt_pass - read
        needed = f"{decoding / budget:.2f}x" if budget > 0 else "never"
        print(f"{example.task:15s} {ids.shape[1]:4d} prompt tokens, {stats.new_tokens:3d} tokens, "
              f"{stats.new_tokens / stats.blocks:.2f} a block, {stats.drafted_tokens / speculative:.2f} drafts a "
              f"speculative block; passes {full * 1000:.0f} / {draft * 1000:.0f} ms, c {draft / full:.2f}; alpha "
              f"{kept:.2f}, top-3 {top3:.2f}, chain ceiling {ceiling(kept, draft / full):.2f}x; prompt pass "
              f"{prompt_pass:.2f} s, read {read:.2f} s, greedy {greedy:.2f} s, VIA-SD {spent:.2f} s "
              f"({greedy / spent:.2f}x), decoding {decoding / max(spent - prompt_pass - read, 1e-9):.2f}x, "
              f"{TARGET_SPEEDUP}x needs decoding at {needed}", flush=True)


if __name__ == "__main__":
    main()
