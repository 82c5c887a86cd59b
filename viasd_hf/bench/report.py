"""What ``viasd bench`` shows: a Markdown table, the run's environment, and two pictures."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

from viasd_hf import __version__
from viasd_hf.engine.attention import Bucket, kernel_choices
from viasd_hf.extras import require

QUALITY_COLUMNS = (("rougeL", "ROUGE-L"), ("bleu", "BLEU"), ("chrf", "chrF"), ("exact_match", "EM"), ("pass@1", "pass@1"))


def _cell(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    """One row per method: speed, work per token, quality; quality columns only for metrics some task produced."""
    shown = [(key, label) for key, label in QUALITY_COLUMNS if any(key in row["quality"] for row in summary.values())]
    header = ["method", "tokens/s", "× greedy", "accepted / full call", "rejection rate", "full calls / token",
              "greedy agreement", "full-model agreement", *(label for _, label in shown), "peak memory (MiB)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in summary.items():
        cells = [
            name,
            _cell(row["tokens_per_s"]),
            _cell(row["speedup_vs_greedy"]),
            _cell(row["mean_accepted"]),
            _cell(row["rejection_rate"]),
            _cell(row["full_calls_per_token"]),
            _cell(row["quality"]["greedy_agreement"]),
            _cell(row["quality"].get("full_model_agreement"), 3),
            *(_cell(row["quality"].get(key), 1) for key, _ in shown),
            _cell(row["peak_memory_mib"], 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_task_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """Speed-up over greedy per task and method, then how often the adaptive slim tier ran per task."""
    tasks = list(next(iter(summary.values()))["per_task"])
    lines = ["| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for name, row in summary.items():
        lines.append(f"| {name} | " + " | ".join(_cell(row["per_task"][t]["speedup_vs_greedy"]) for t in tasks) + " |")
    for name, row in summary.items():
        if row.get("slim_on_fraction") is not None:
            shares = " | ".join(_cell(row["per_task"][t].get("slim_on_fraction")) for t in tasks)
            lines.append(f"| {name}: slim tier on (share of blocks) | {shares} |")
    return "\n".join(lines)


def slim_tier_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """Per task, for each of our decoders with a slim tier: the slim tier's agreement with the full model where it
    checked the slim tier, and the escalation rate."""
    tasks = list(next(iter(summary.values()))["per_task"])
    lines = ["| method | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
    for name, row in summary.items():
        cells = []
        for task in tasks:
            work = row["per_task"][task]
            cells.append(f"{_cell(work.get('slim_agreement'))} · {_cell(work.get('escalation_rate'))}")
        if row.get("slim_on_fraction") is not None or (row.get("slim_forwards_per_token") or 0) > 0:  # with a slim tier
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_lines(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Per method and task, where the slim tier's on/off choice stood after the task's last prompt, and why."""
    return [
        f"- {name} · {task}: {work['slim_tier_verdict']}"
        for name, row in summary.items()
        for task, work in row.get("per_task", {}).items()
        if work.get("slim_tier_verdict")
    ]


def time_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """Where each of our decoders spends its time, with the work per token that explains it."""
    lines = ["| method | drafter | slim passes | full passes | loop overhead | full calls / token | slim passes / token "
             "| escalation rate | slim tier on | shadow probes | blocks plain |", "|" + "---|" * 11]
    for name, row in summary.items():
        shares = row.get("time_shares")
        if not shares:
            continue
        lines.append(
            f"| {name} | " + " | ".join(f"{shares[part]:.0%}" for part in ("drafter", "slim", "full", "overhead"))
            + f" | {_cell(row['full_calls_per_token'])} | {_cell(row['slim_forwards_per_token'])} "
            f"| {_cell(row['escalation_rate'])} | {_cell(row['slim_on_fraction'])} | {_cell(row.get('slim_shadow_fraction'))} "
            f"| {_cell(row.get('plain_fraction'))} |"
        )
    return "\n".join(lines)


def _bucket_order(item: tuple[Bucket, str]) -> tuple:
    bucket = item[0]
    return bucket.attention.__name__, str(bucket.dtype), bucket.query_rows, bucket.kv_length


def _git(folder: Path, *args: str) -> str | None:
    """What ``git -C folder args`` prints, or ``None`` where git is missing or fails."""
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_revision(package: Path | None = None) -> dict[str, str | bool | None]:
    """The git commit of the source tree ``package`` (viasd_hf's folder by default) is imported from, and whether
    that checkout has changes not committed (``git status --porcelain``); ``None`` for either where it is not known:
    no git, or a package that git does not track there (an installed wheel)."""
    folder = Path(package or Path(__file__).parents[1]).resolve()
    if _git(folder, "ls-files", "--error-unmatch", "__init__.py") is None:
        return {"commit": None, "dirty": None}
    commit, status = _git(folder, "rev-parse", "HEAD"), _git(folder, "status", "--porcelain")
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}


def environment(bandwidth_gb_s: float | None = None, load: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, threads and hardware: a ratio means little without the machine it was measured on; and the
    commit of the source that measured it. ``bandwidth_gb_s``: the machine's measured memory bandwidth, where the
    caller measured it; ``load``: the background load the figures were measured under
    (:meth:`viasd_hf.bench.load.Load.record`), where the caller started one or chose none."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "viasd_hf": __version__,
        **source_revision(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "machine_bandwidth_gb_s": bandwidth_gb_s,
        "load": load,
        "attention_kernels": {  # what the measured kernel choice (viasd_hf.engine.attention) settled on in this run
            f"{bucket.attention.__name__} {str(bucket.dtype).removeprefix('torch.')} rows<={bucket.query_rows} "
            f"cache<={bucket.kv_length}": choice
            for bucket, choice in sorted(kernel_choices().items(), key=_bucket_order)
        },
    }


def plots(summary: dict[str, dict[str, Any]], directory: str | Path) -> list[Path]:
    """``speedup_vs_quality.png`` (speed-up against greedy agreement per method) and ``tier_fractions.png``
    (who produced the tokens, per task, for each method that drafts)."""
    require("matplotlib", "bench", "viasd bench --plots").use("Agg")
    plt = require("matplotlib.pyplot", "bench", "viasd bench --plots")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 4.5))
    for name, row in summary.items():
        if row["speedup_vs_greedy"] is None:  # greedy produced no token on any prompt
            continue
        axes.scatter(row["quality"]["greedy_agreement"], row["speedup_vs_greedy"], s=40)
        axes.annotate(name, (row["quality"]["greedy_agreement"], row["speedup_vs_greedy"]), fontsize=8,
                      xytext=(4, 3), textcoords="offset points")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("agreement with greedy output (fraction of tokens)")
    axes.set_ylabel("speed-up over greedy (median over prompts)")
    axes.set_title("Speed against fidelity")
    figure.tight_layout()
    speed_path = directory / "speedup_vs_quality.png"
    figure.savefig(speed_path, dpi=120)
    plt.close(figure)

    drafting = [name for name, row in summary.items() if row["tier_fractions"]["drafter"] > 0]
    tasks = list(next(iter(summary.values()))["per_task"])
    figure, axes = plt.subplots(figsize=(min(12.0, max(6.0, 0.25 * len(tasks) * len(drafting))), 4.5))
    width = 0.8 / max(1, len(drafting))
    colours = {"drafter": "tab:green", "slim": "tab:orange", "full": "tab:blue"}
    for offset, name in enumerate(drafting):
        bottom = [0.0] * len(tasks)
        positions = [t + offset * width for t in range(len(tasks))]
        for tier, colour in colours.items():
            heights = [summary[name]["per_task"][task]["tier_fractions"][tier] for task in tasks]
            axes.bar(positions, heights, width, bottom=bottom, color=colour, edgecolor="white", linewidth=0.5,
                     label=tier if offset == 0 else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for position in positions:
            axes.text(position, 1.01, name, rotation=90, fontsize=6, ha="center", va="bottom")
    axes.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, rotation=20)
    axes.set_ylim(0, 1.35)
    axes.set_ylabel("fraction of generated tokens")
    axes.set_title("Who produced the tokens (drafter kept / slim verifier / full model)")
    axes.legend(loc="upper right", fontsize=8, ncols=3)
    figure.tight_layout()
    tiers_path = directory / "tier_fractions.png"
    figure.savefig(tiers_path, dpi=120)
    plt.close(figure)
    return [speed_path, tiers_path]
