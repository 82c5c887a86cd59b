"""Where lossless VIA-SD's tokens are not the full model's teacher-forced argmax in bf16, how far off are they?

Lossless decoding is token-identical to ``generate`` in fp32 (the tests), yet its full-model agreement
(``full_model_agreement`` in ``viasd_hf/bench/runner.py``) is below 1 in bf16. This decodes some prompts with lossless VIA-SD
and, at every token that is not the teacher-forced pass's argmax, prints the gap between the top
logit and the token's logit, and whether the token was the second choice. Gaps of 0 or one bf16 step
(0.0625 near 15) are rounding ties, not a lossy decision.

    python bench/studies/full_model_agreement/ties.py [--dataset xsum] [--limit 6] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from viasd_hf.bench.methods import MethodTable
from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="xsum")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, quantization="auto", draft_for=TARGET)
    mask = RoutingMask.from_pretrained((TARGET, DRAFTER), local_files_only=True)
    lossless = MethodTable(target, drafter, mask, None).build(["greedy", "viasd_lossless"])["viasd_lossless"]
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "return_dict_in_generate": True,
              "pad_token_id": tokenizer.pad_token_id}
    tokens_seen, off = 0, []
    for example in load_examples(args.dataset, args.limit):
        ids = encode(tokenizer, example.prompt)
        tokens = lossless(ids, common).tokens
        with torch.no_grad():
            logits = target(torch.cat([ids, torch.tensor([tokens[:-1]])], -1), logits_to_keep=len(tokens)).logits[0].float()
        top = logits.topk(2, -1)
        tokens_seen += len(tokens)
        off += [(float(top.values[i, 0] - logits[i, token]), token == int(top.indices[i, 1]), float(top.values[i, 0]))
                for i, token in enumerate(tokens) if token != int(top.indices[i, 0])]
    print(f"{len(off)} of {tokens_seen} tokens are not the teacher-forced argmax")
    for gap, second, top_logit in off:
        print(f"  gap {gap:.4f} below the top logit {top_logit:.4f}; the second choice: {second}")


if __name__ == "__main__":
    main()
