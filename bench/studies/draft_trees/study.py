"""Would verifying a tree of drafts (several candidates per position) lift short answers to 1.6x greedy?

``record``: for each prompt (``--per-task`` of each Spec-Bench task and of WMT14) the target's greedy continuation is
decoded with ``generate``; the drafter's drafting copy then reads prompt and continuation in one pass (teacher-forced),
which gives, at every position, the rank of the target's token among the drafter's choices. Pass costs are measured
too: the target and the drafting copy over 1 .. ``LARGEST_TREE`` new tokens after ``CACHED`` cached ones (the copy with
its whole LM head, as a user's own assistant drafts). Written to a JSON file.

``report`` replays blocks on the recorded ranks, with no model in the loop. A static draft tree (a set of rank paths,
Medusa's and Sequoia's form) keeps ``d`` drafts of a block exactly when the target's next ``d`` tokens have ranks
forming a path of the tree, and the target's pass gives one token more. A block of a tree of ``N`` nodes costs one
target pass over ``N + 1`` tokens and one drafter pass per depth, over the nodes of the depth above that have
children. Three families, each at its best size per task:

- a chain of ``k`` first choices (what VIA-SD drafts);
- the chain with the drafter's second choice beside each draft, as a leaf: it widens the verifying pass only, since
  the chain's own drafter passes give every depth's second choice;
- a tree grown one node at a time (a child of the root or of a node, ranks below 4), each time the node that most
  raises the replayed speed-up: fitted on the ranks it is scored on (optimistic), though growing one node at a time
  can stop short of a better tree.

The speed-up is tokens per block over the block's cost in one-token target passes: the loop's own work and the
prompt's reads are left out, as in ``bench/studies/short_answers``.

    HF_HUB_OFFLINE=1 python bench/studies/draft_trees/study.py record RANKS.json [--per-task 3] [--tokens 64]
    python bench/studies/draft_trees/study.py report RANKS.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import DynamicCache

from viasd_hf.bench.runner import encode
from viasd_hf.data.tasks import load_examples
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.models.loading import load_pretrained

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CACHED, REPEATS, DEEPEST_RANK, LARGEST_TREE = 300, 5, 8, 48


def pass_ms(model: torch.nn.Module, width: int) -> float:
    """A pass over ``width`` new tokens after ``CACHED`` cached ones, logits for all of them, in ms (median)."""
    generator = torch.Generator().manual_seed(width)
    cache = DynamicCache(config=model.config)
    model(torch.randint(100, 5000, (1, CACHED), generator=generator), cache=cache, use_cache=True)
    fed = torch.randint(100, 5000, (1, width), generator=generator)
    times = []
    for _ in range(REPEATS + 1):
        started = time.perf_counter()
        model(fed, cache=cache, use_cache=True, logits_to_keep=width)
        times.append(time.perf_counter() - started)
        cache.crop(-width)
    return 1000 * statistics.median(times[1:])


def ranks_of(drafter: torch.nn.Module, prompt: torch.Tensor, sequence: torch.Tensor) -> list[int]:
    """The rank of each generated token among the drafter's choices at its position, teacher-forced (capped)."""
    logits = drafter(sequence).logits[0, prompt.shape[1] - 1 : -1].float()
    chosen = logits.gather(-1, sequence[0, prompt.shape[1] :, None])
    return (logits > chosen).sum(-1).clamp(max=DEEPEST_RANK).tolist()


def block_cost(tree: set[tuple[int, ...]], target_ms: dict[int, float], drafter_ms: dict[int, float]) -> float:
    """A block's milliseconds: drafter passes over each depth's parents, one target pass over the tree and its root."""
    depth = max(map(len, tree))
    parents = [len({path[:level] for path in tree if len(path) == level + 1}) for level in range(depth)]
    return target_ms[len(tree) + 1] + sum(drafter_ms[width] for width in parents)


def replay(tree: set[tuple[int, ...]], ranks: list[int]) -> tuple[int, int]:
    """Blocks and tokens of decoding ``ranks`` with ``tree``: each block keeps the longest path of the tree that the
    target's next ranks follow, plus the target's own token."""
    blocks = tokens = position = 0
    while position < len(ranks):
        kept = 0
        while position + kept < len(ranks) and tuple(ranks[position : position + kept + 1]) in tree:
            kept += 1
        position += kept + 1
        blocks, tokens = blocks + 1, tokens + kept + 1
    return blocks, min(tokens, len(ranks))


def grown_tree(lists: list[list[int]], target_ms: dict[int, float], drafter_ms: dict[int, float],
               largest: int) -> set[tuple[int, ...]]:
    """The tree grown one node at a time, each time the child (of the root or of a node, ranks below 4) that most
    raises the replayed speed-up on ``lists``, while one does."""
    tree: set[tuple[int, ...]] = set()
    best = 1.0
    while len(tree) < largest:
        candidates = {(*parent, rank) for parent in tree | {()} for rank in range(4)} - tree
        scored = [(speedup(tree | {child}, lists, target_ms, drafter_ms)[1], child) for child in candidates]
        gain, child = max(scored)
        if gain <= best:
            return tree
        tree, best = tree | {child}, gain
    return tree


def speedup(tree: set[tuple[int, ...]], lists: list[list[int]], target_ms: dict[int, float],
            drafter_ms: dict[int, float]) -> tuple[float, float]:
    """Tokens a block and speed-up over plain decoding of decoding every rank list with ``tree``."""
    blocks = tokens = 0
    for ranks in lists:
        each_blocks, each_tokens = replay(tree, ranks)
        blocks, tokens = blocks + each_blocks, tokens + each_tokens
    return tokens / blocks, tokens * target_ms[1] / (blocks * block_cost(tree, target_ms, drafter_ms))


def record(per_task: int, tokens: int, path: str) -> None:
    """Pass costs and each prompt's ranks, written to ``path``."""
    torch.set_grad_enabled(False)
    target, tokenizer = load_pretrained(TARGET, dtype=torch.bfloat16)
    drafter, _ = load_pretrained(DRAFTER, dtype=torch.bfloat16)
    copy = fastest_form(drafter, now=True)
    recorded = {"threads": torch.get_num_threads(),
                "target_ms": {width: pass_ms(target, width) for width in range(1, LARGEST_TREE + 2)},
                "drafter_ms": {width: pass_ms(copy, width) for width in range(1, LARGEST_TREE + 1)},
                "ranks": defaultdict(list)}
    for example in load_examples("spec_bench", per_task) + load_examples("wmt14", per_task):
        prompt = encode(tokenizer, example.prompt)
        sequence = target.generate(prompt, max_new_tokens=tokens, do_sample=False)
        recorded["ranks"][example.task].append(ranks_of(copy, prompt, sequence))
    Path(path).write_text(json.dumps(recorded))


def report(path: str) -> None:
    recorded = json.loads(Path(path).read_text())
    target_ms = {int(width): ms for width, ms in recorded["target_ms"].items()}
    drafter_ms = {int(width): ms for width, ms in recorded["drafter_ms"].items()}
    print(f"{recorded['threads']} threads, {CACHED} cached tokens; ms a pass over 1/4/8/16/32 tokens: target "
          + "/".join(f"{target_ms[w]:.0f}" for w in (1, 4, 8, 16, 32)) + ", drafter "
          + "/".join(f"{drafter_ms[w]:.0f}" for w in (1, 4, 8, 16, 32)))
    chains = {k: {(0,) * depth for depth in range(1, k + 1)} for k in range(1, 17)}
    beside = {k: chain | {(0,) * (depth - 1) + (1,) for depth in range(1, k + 1)} for k, chain in chains.items()}
    print("| task | tokens | chain: k, tokens a block, speed-up | with second choices: k, tokens a block, speed-up "
          "| grown tree: nodes, depth, tokens a block, speed-up |")
    print("|---|---:|---|---|---|")
    for task, lists in recorded["ranks"].items():
        def best(family: dict[int, set[tuple[int, ...]]]) -> str:
            k, tree = max(family.items(), key=lambda item: speedup(item[1], lists, target_ms, drafter_ms)[1])
            tokens, speed = speedup(tree, lists, target_ms, drafter_ms)
            return f"{k}, {tokens:.2f}, {speed:.2f}x"
        tree = grown_tree(lists, target_ms, drafter_ms, LARGEST_TREE)
        tokens, speed = speedup(tree, lists, target_ms, drafter_ms)
        print(f"| {task} | {sum(map(len, lists))} | {best(chains)} | {best(beside)} | {len(tree)}, "
              f"{max(map(len, tree))}, {tokens:.2f}, {speed:.2f}x |")

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["record", "report"])
    parser.add_argument("path")
    parser.add_argument("--per-task", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if args.command == "record":
        record(args.per_task, args.tokens, args.path)
    report(args.path)


if __name__ == "__main__":
    main()
