"""Side-by-side ratios from ``viasd bench --json`` runs: each method against a reference, and each lever on/off.

A ratio is taken prompt by prompt inside one run (both methods decoded the same prompt in the
same process, interleaved), then the median over prompts is kept, as ``viasd bench`` does for
its speed-ups over greedy. Runs are never compared with each other: each table row is one run.

    python -m viasd_hf.bench.compare RUN.json [RUN.json ...] [--reference hf_assisted]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# (lever, method with it, method without it): an ablation is read only where a run has both
LEVERS = (
    ("slim tier (tiered)", "viasd", "two_tier"),
    ("slim tier (tiered, hybrid)", "viasd_hybrid", "two_tier_hybrid"),
    ("slim tier (lossless)", "viasd_lossless", "two_tier"),
    ("slim tier always on, fixed draft rule (tiered)", "viasd_nocost", "two_tier_nocost"),
    ("slim tier (lossless, hybrid)", "viasd_lossless_hybrid", "two_tier_hybrid"),
    ("hybrid drafting (lossless)", "viasd_lossless_hybrid", "viasd_lossless"),
    ("hybrid drafting (tiered)", "viasd_hybrid", "viasd"),
    ("draft vocabulary (lossless)", "viasd_lossless", "viasd_lossless_fullvocab"),
    ("draft vocabulary (lossless, hybrid)", "viasd_lossless_hybrid", "viasd_lossless_hybrid_fullvocab"),
    ("cost model: draft planner + slim switch (lossless)", "viasd_lossless", "viasd_lossless_nocost"),
    ("cost model: draft planner + slim switch (lossless, hybrid)", "viasd_lossless_hybrid", "viasd_lossless_hybrid_nocost"),
    ("quantised models (--quantize), HF assisted", "hf_assisted", "hf_assisted_bf16"),
    ("quantised models + ours vs HF assisted bf16", "viasd_lossless", "hf_assisted_bf16"),
    ("timings steer (attention kernel, plain fallback, drafter's form; lossless)", "viasd_lossless",
     "viasd_lossless_reproducible"),
    ("attention kernel measured per shape, HF assisted", "hf_assisted_fastattn", "hf_assisted"),
    ("drafter reads a window of a long prompt (lossless)", "viasd_lossless", "viasd_lossless_fullprompt"),
    ("ours vs HF assisted, both with the measured kernel", "viasd_lossless", "hf_assisted_fastattn"),
)
QUALITY_KEYS = ("rougeL", "bleu", "exact_match", "pass@1")


def prompt_ratios(run: dict[str, Any], method: str, reference: str) -> list[tuple[str, float]]:
    """(task, tokens/s of ``method`` ÷ tokens/s of ``reference``) for every prompt both decoded."""
    ratios = []
    for mine, theirs in zip(run["outputs"][method], run["outputs"][reference]):
        if mine["tokens"] and theirs["tokens"]:  # seconds: every repeat; the median is the prompt's time, as in the bench
            speed, their_speed = (o["tokens"] / statistics.median(o["seconds"]) for o in (mine, theirs))
            ratios.append((mine["task"], speed / their_speed))
    return ratios


def median_ratio(run: dict[str, Any], method: str, reference: str) -> float:
    return statistics.median(ratio for _, ratio in prompt_ratios(run, method, reference))


def lowest_task_ratio(run: dict[str, Any], method: str, reference: str) -> tuple[str, float]:
    """The task where ``method`` does worst against ``reference`` (median over the task's prompts)."""
    by_task: dict[str, list[float]] = {}
    for task, ratio in prompt_ratios(run, method, reference):
        by_task.setdefault(task, []).append(ratio)
    return min(((task, statistics.median(r)) for task, r in by_task.items()), key=lambda item: item[1])


def run_label(run: dict[str, Any]) -> str:
    options = run["options"]
    label = options.get("dataset") or Path(options.get("prompts") or "prompts").name
    label += f" ×{len(run['outputs']['greedy'])}"
    label += f", T={options['temperature']}" if options.get("temperature") else ", greedy"
    quantized = options.get("quantize") or {}
    if quantized:
        label += ", " + ", ".join(f"{role} {scheme}" for role, scheme in sorted(quantized.items()))
    return label


def _quality(row: dict[str, Any]) -> str:
    found = [f"{key} {row['quality'][key]:.1f}" for key in QUALITY_KEYS if key in row["quality"]]
    return ", ".join(found) or "–"


def methods_markdown(run: dict[str, Any], reference: str) -> str:
    """One run: every method against greedy and against ``reference``, with quality and where time went."""
    rows = [f"| method | × greedy | × {reference} | lowest task × {reference} | greedy agreement | full-model agreement | "
            "quality | slim tier on | drafting share of time |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in run["methods"].items():
        versus, lowest = "–", "–"
        if reference in run["outputs"] and name != reference:
            versus = f"{median_ratio(run, name, reference):.2f}"
            task, ratio = lowest_task_ratio(run, name, reference)
            lowest = f"{ratio:.2f} ({task})"
        slim_on = row.get("slim_on_fraction")
        drafting = (row.get("time_shares") or {}).get("drafter")
        full_agreement = row["quality"].get("full_model_agreement")
        rows.append(
            f"| {name} | {row['speedup_vs_greedy']:.2f} | {versus} | {lowest} | {row['quality']['greedy_agreement']:.2f} | "
            f"{'–' if full_agreement is None else f'{full_agreement:.3f}'} | {_quality(row)} | {'–' if slim_on is None else f'{slim_on:.2f}'} | "
            f"{'–' if drafting is None else f'{drafting:.0%}'} |"
        )
    return "\n".join(rows)


def levers_markdown(runs: list[dict[str, Any]]) -> str:
    """Each lever on ÷ off, per run (median over prompts of the per-prompt speed ratio)."""
    labels = [run_label(run) for run in runs]
    rows = ["| lever | with ÷ without | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(runs)]
    for lever, with_it, without in LEVERS:
        cells = [f"{median_ratio(run, with_it, without):.2f}" if {with_it, without} <= set(run["outputs"]) else "–"
                 for run in runs]
        if any(cell != "–" for cell in cells):
            rows.append(f"| {lever} | `{with_it}` ÷ `{without}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viasd_hf.bench.compare", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files written by viasd bench --json")
    parser.add_argument("--reference", default="hf_assisted", help="the method every other one is compared with")
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    for path, run in zip(args.runs, runs):
        print(f"### {run_label(run)} ({path.name})\n\n`{run['command']}`\n\n{methods_markdown(run, args.reference)}\n")
    print("### Levers\n\n" + levers_markdown(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
