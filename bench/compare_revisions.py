"""Is the decode loop at one git revision slower than at another? Ratios from one run.

Runs the same VIA-SD generations on SmolLM2-135M-Instruct, or a tiny random model (prompt lookup drafting; two-tier, tiered
and lossless, greedy and sampled) with the package from each revision, in alternating subprocesses
so that machine load affects both alike, and prints seconds per token and the ratio new / old.
Greedy outputs must match between the revisions for lossless and two-tier decoding; that is checked.

    python bench/compare_revisions.py --old 8cef864 --new HEAD --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run inside each subprocess, with the revision's package first on sys.path.
WORKLOAD = r'''
import json, sys, time, torch
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.models.loading import load_pretrained

torch.set_num_threads(int(sys.argv[1]))
if sys.argv[3] == "tiny":  # a 4-layer random model: the loop's own overhead dominates
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).eval()
    mask = RoutingMask.from_model(model, skip=[2])
    prompts = [torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(i)).repeat(1, 3) for i in range(4)]
else:
    model, tokenizer = load_pretrained(sys.argv[3])
    mask = RoutingMask.from_model(model, skip=[4, 9, 14, 19])
    questions = ["List ten fruits, one per line.", "Write a Python function that reverses a string.",
                 "Explain what a hash map is in two sentences.", "Repeat after me: the cat sat on the mat, the cat sat."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for q in questions]
enable_viasd(model)
setups = {
    "two_tier": ViaSDConfig(routing_mask=mask, use_slim=False),
    "tiered": ViaSDConfig(routing_mask=mask, adaptive=False),
    "lossless": ViaSDConfig(routing_mask=mask, mode="lossless", adaptive=False),
}
import viasd_hf
results = {"package": viasd_hf.__file__}
for sampled in (False, True):
    for name, config in setups.items():
        key = name + ("_sampled" if sampled else "")
        seconds, tokens, outputs = 0.0, 0, []
        for i, ids in enumerate(prompts):
            torch.manual_seed(i)
            options = dict(do_sample=True, temperature=0.8) if sampled else dict(do_sample=False)
            model.generate(ids, viasd_config=config, prompt_lookup_num_tokens=4, max_new_tokens=8, pad_token_id=0,
                           **options)  # warm-up
            torch.manual_seed(i)
            started = time.perf_counter()
            out = model.generate(ids, viasd_config=config, prompt_lookup_num_tokens=4, max_new_tokens=int(sys.argv[2]),
                                 pad_token_id=0, **options)
            seconds += time.perf_counter() - started
            tokens += out.shape[1] - ids.shape[1]
            outputs.append(out[0, ids.shape[1]:].tolist())
        results[key] = {"seconds": seconds, "tokens": tokens, "outputs": outputs}
print(json.dumps(results))
'''


def run_once(tree: Path, threads: int, max_new_tokens: int, model: str) -> dict:
    command = [
        sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); exec({WORKLOAD!r})", str(threads),
        str(max_new_tokens), model,
    ]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if not results.pop("package").startswith(str(tree)):
        raise RuntimeError(f"the run for {tree} imported viasd_hf from elsewhere")
    return results


def checkout(revision: str, where: Path) -> Path:
    """A detached worktree of ``revision``: its package is imported from there, whatever the working tree holds."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), revision], check=True,
                   capture_output=True)
    return where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision to compare against (e.g. a commit before a change)")
    parser.add_argument("--new", default=None, help="git revision to measure (default: the working tree as it is)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating old/new runs (default 5)")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a zoo name, or 'tiny' (a random 4-layer model: the loop's own overhead)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"old": checkout(args.old, Path(scratch, "old"))}
        trees["new"] = checkout(args.new, Path(scratch, "new")) if args.new else ROOT
        try:
            runs = {"old": [], "new": []}
            for round_ in range(args.rounds):
                order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
                for label in order:
                    runs[label].append(run_once(trees[label], args.threads, args.max_new_tokens, args.model))
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    print(f"{'setup':<18} {'old ms/token':>13} {'new ms/token':>13} {'new/old':>8}  (medians of {args.rounds} runs each)")
    ratios = []
    for key in runs["old"][0]:
        old = statistics.median(r[key]["seconds"] / r[key]["tokens"] for r in runs["old"])
        new = statistics.median(r[key]["seconds"] / r[key]["tokens"] for r in runs["new"])
        ratios.append(new / old)
        print(f"{key:<18} {old * 1000:>13.2f} {new * 1000:>13.2f} {new / old:>8.3f}")
        if not key.endswith("sampled") and key != "tiered":
            same = runs["old"][0][key]["outputs"] == runs["new"][0][key]["outputs"]
            print(f"{'':<18} greedy outputs identical across revisions: {same}")
    print(f"geometric mean new/old: {statistics.geometric_mean(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
