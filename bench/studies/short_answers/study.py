"""Why short answers stay near 1.3x greedy: per Spec-Bench task, what lossless VIA-SD's own passes cost and keep.

Decodes the first prompt of each task (``viasd bench --limit 1``'s) with ``ViaSDConfig()`` and the bf16 pair, as a user
would, twice (the first call measures its passes' shapes), and prints from the second call's ``viasd_stats``:
tokens per block, drafts per speculative block, the target's and the drafter's seconds per pass (the target's include
the pass that read the prompt) and their ratio c; then α, how often the bf16 drafter's first choice is the output's
next token (teacher-forced on it; and how often one of its first three is), the ceiling of chain drafting, max over k of (1 + α + … + α^k) / (1 + k·c), and the
c that would let it reach 1.6x.

    HF_HUB_OFFLINE=1 python bench/studies/short_answers/study.py
"""

from __future__ import annotations

import torch

from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def ceiling(kept: float, cost: float, longest: int = 16) -> float:
    """The best speed-up of chain drafting over plain decoding when each draft is kept with chance ``kept`` and a drafter
    pass costs ``cost`` of a verifying pass (verifying k + 1 tokens costing what one does)."""
    return max(sum(kept**j for j in range(k + 1)) / (1 + k * cost) for k in range(1, longest + 1))


def cost_for(kept: float, speedup: float = 1.6) -> float:
    """The largest drafter cost at which chain drafting can still reach ``speedup`` with this ``kept``."""
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if ceiling(kept, middle) >= speedup else (low, middle)
    return low


def main() -> None:
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, dtype=torch.bfloat16)
    fastest_form(drafter, now=True)  # the drafting copy made before the calls, as a bench makes it
    enable_viasd(target)
    for example in load_examples("spec_bench", 1):
        ids = encode(tokenizer, example.prompt)
        for _ in range(2):
            out = target.generate(ids, assistant_model=drafter, viasd_config=ViaSDConfig(), max_new_tokens=128,
                                  do_sample=False, return_dict_in_generate=True)
        stats = out.viasd_stats
        speculative = max(stats.blocks - stats.plain_blocks, 1)
        with torch.inference_mode():
            choices = drafter(out.sequences).logits[0, ids.shape[1] - 1 : -1].topk(3, dim=-1).indices
        matches = choices == out.sequences[0, ids.shape[1] :, None]
        kept, top3 = matches[:, 0].float().mean().item(), matches.any(-1).float().mean().item()
        full = stats.seconds["full"] / max(stats.full_forwards, 1)
        draft = stats.seconds["drafter"] / max(stats.drafter_forwards, 1)
        print(f"{example.task:15s} {stats.new_tokens:3d} tokens, {stats.new_tokens / stats.blocks:.2f} a block, "
              f"{stats.drafted_tokens / speculative:.2f} drafts a speculative block; passes {full * 1000:.0f} / "
              f"{draft * 1000:.0f} ms, c {draft / full:.2f}; alpha {kept:.2f}, ceiling "
              f"{ceiling(kept, draft / full):.2f}x, 1.6x needs c <= {cost_for(kept):.2f}; top-3 matches {top3:.2f}")


if __name__ == "__main__":
    main()
