"""Side-by-side decoding speed: every method on the same prompts, interleaved, in one process.

The first method is the reference (plain ``generate``: greedy, or sampling with ``temperature``).

Ratios to plain greedy are only meaningful when measured in the same run (machine load moves
absolute tokens/s by ±15 % here, DESIGN §9), so methods alternate prompt by prompt after a
warm-up, and each ratio is the median over prompts of (method tokens/s) / (greedy tokens/s).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .calibration import spec_bench_path
from .config import ViaSDConfig
from .generation import enable_viasd
from .masks import RoutingMask



@dataclass
class MethodResult:
    tokens_per_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    sequences: list[list[int]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "tokens_per_s": statistics.median(self.tokens_per_s),
            "speedup_vs_greedy": statistics.median(self.ratios),
        }
        if self.stats:
            drafted = sum(s["drafted_tokens"] for s in self.stats)
            accepted = sum(s["accepted_tokens"] for s in self.stats)
            new = sum(s["new_tokens"] for s in self.stats)
            full_calls = sum(s["full_forwards"] - s["prefill_forwards"] for s in self.stats)
            row |= {
                "rejection_rate": 1 - accepted / drafted if drafted else 0.0,
                "full_calls_per_token": full_calls / new if new else 0.0,
                "mean_accepted": new / full_calls if full_calls else float(new),
                "escalated_blocks": sum(s["escalated_blocks"] for s in self.stats),
                "slim_committed_tokens": sum(s["slim_committed_tokens"] for s in self.stats),
                "slim_on_blocks": sum(s["slim_on_blocks"] for s in self.stats),
                "slim_off_blocks": sum(s["slim_off_blocks"] for s in self.stats),
            }
        return row


def load_prompts(path: Path | None = None, limit: int = 4, per_category: int | None = None) -> list[str]:
    """First-turn prompts, ``per_category`` from each Spec-Bench category (or simply the first ``limit``)."""
    return [text for _, text in load_categorised_prompts(path, limit, per_category)]


def load_categorised_prompts(
    path: Path | None = None, limit: int = 4, per_category: int | None = None
) -> list[tuple[str, str]]:
    """``(category, first-turn prompt)`` pairs, ``per_category`` from each category (Spec-Bench by default)."""
    rows = [json.loads(line) for line in (path or spec_bench_path()).read_text().splitlines() if line.strip()]
    if per_category:
        seen: dict[str, int] = {}
        picked = []
        for row in rows:
            category = row.get("category", "all")
            if seen.get(category, 0) < per_category:
                seen[category] = seen.get(category, 0) + 1
                picked.append(row)
        rows = picked
    return [(row.get("category", "all"), row["turns"][0] if "turns" in row else row["prompt"]) for row in rows[:limit]]


def method_table(
    target: nn.Module, drafter: nn.Module, mask: RoutingMask, common: dict[str, Any], drafting: dict[str, Any]
) -> dict[str, Callable[[torch.Tensor], Any]]:
    """The peers a user would otherwise pick, and VIA-SD, as callables on one prompt.

    ``drafting`` (γ, draft confidence threshold) applies to every VIA-SD variant alike.
    """
    enable_viasd(target)
    configs = {
        "two_tier": ViaSDConfig(use_slim=False, **drafting),
        "viasd": ViaSDConfig.paper(routing_mask=mask, **drafting),
        "viasd_static": ViaSDConfig.paper(routing_mask=mask, adaptive=False, **drafting),
        "viasd_lossless": ViaSDConfig(routing_mask=mask, mode="lossless", **drafting),
    }

    def viasd_method(config: ViaSDConfig) -> Callable[[torch.Tensor], Any]:
        return lambda ids: target.generate(ids, assistant_model=drafter, viasd_config=config, **common)

    return {
        "greedy": lambda ids: target.generate(ids, **common),
        "hf_assisted": lambda ids: target.generate(ids, assistant_model=drafter, **common),
    } | {name: viasd_method(config) for name, config in configs.items()}


@torch.no_grad()
def compare_speed(
    target: nn.Module,
    tokenizer: Any,
    drafter: nn.Module,
    mask: RoutingMask,
    prompts: list[str],
    max_new_tokens: int = 64,
    methods: list[str] | None = None,
    drafting: dict[str, Any] | None = None,
    temperature: float | None = None,
    categories: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Methods side by side; greedy unless ``temperature`` is given (then every method samples, seeded alike)."""
    common: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False, "return_dict_in_generate": True}
    if temperature is not None:
        common |= {"do_sample": True, "temperature": temperature}
    table = method_table(target, drafter, mask, common, drafting or {})
    chosen = {name: table[name] for name in (methods or list(table))}
    results = {name: MethodResult() for name in chosen}
    encoded = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        for p in prompts
    ]
    for generate in chosen.values():  # warm-up
        generate(encoded[0][:, :16])
    with tqdm(total=len(encoded) * len(chosen), desc="speed") as bar:
        for index, ids in enumerate(encoded):
            order = list(chosen.items())
            order = order[index % len(order) :] + order[: index % len(order)]
            speeds = {}
            for name, generate in order:
                torch.manual_seed(index)
                started = time.perf_counter()
                out = generate(ids)
                seconds = time.perf_counter() - started
                new = out.sequences.shape[1] - ids.shape[1]
                speeds[name] = new / seconds
                results[name].tokens_per_s.append(speeds[name])
                results[name].sequences.append(out.sequences[0, ids.shape[1] :].tolist())
                if getattr(out, "viasd_stats", None) is not None:
                    results[name].stats.append(out.viasd_stats.to_dict())
                bar.update()
            for name in chosen:
                results[name].ratios.append(speeds[name] / speeds["greedy"])
    summary = {name: result.summary() for name, result in results.items()}
    for name, result in results.items():
        summary[name]["greedy_agreement"] = _agreement(result.sequences, results["greedy"].sequences)
        if categories and result.stats:
            summary[name]["slim_share_by_category"] = _slim_share_by_category(result.stats, categories)
    return summary


def _slim_share_by_category(stats: list[dict[str, Any]], categories: list[str]) -> dict[str, float]:
    """Fraction of blocks in which the adaptive controller ran the slim tier, per prompt category."""
    on: dict[str, int] = {}
    total: dict[str, int] = {}
    for category, row in zip(categories, stats):
        on[category] = on.get(category, 0) + row["slim_on_blocks"]
        total[category] = total.get(category, 0) + row["slim_on_blocks"] + row["slim_off_blocks"]
    return {category: on[category] / total[category] for category in total if total[category]}


def _agreement(sequences: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of generated tokens equal to greedy's at the same position."""
    same = total = 0
    for ours, theirs in zip(sequences, reference):
        total += len(theirs)
        same += sum(a == b for a, b in zip(ours, theirs))
    return same / total if total else 1.0


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| method | tokens/s | × greedy | rejection rate | full calls / token | greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        rejection = f"{row['rejection_rate']:.2f}" if "rejection_rate" in row else "–"
        calls = f"{row['full_calls_per_token']:.2f}" if "full_calls_per_token" in row else ("1.00" if name == "greedy" else "–")
        lines.append(
            f"| {name} | {row['tokens_per_s']:.2f} | {row['speedup_vs_greedy']:.2f} | {rejection} | {calls} | "
            f"{row['greedy_agreement']:.2f} |"
        )
    return "\n".join(lines)
