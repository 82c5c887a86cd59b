"""``auto`` for a drafter: the scheme under which its target decodes fastest, not the most faithful one.

A drafter's output never reaches the user: the target keeps or replaces every token it proposes,
so a quantised drafter that agrees less with its own float32 model costs only speed, through the
drafts its target throws away. So a drafter is measured against its target (``MeasureOptions.judge``)
and judged by the standard model of a speculative block (Leviathan et al., 2023): with ``α`` the
share of positions where the target's argmax is the drafter's, a block of ``γ`` drafts commits
``1 + α + … + α^γ`` tokens and costs ``γ`` drafter passes plus one verifying pass of ``γ + 1``
tokens. A drafter pass costs ``judge_bytes × decode_ratio`` verifying passes (bytes read, as
``draft_planner.StaticCosts`` prices it, times the scheme's measured speed against bf16).
Each scheme is scored by its best block's tokens per unit of cost (``choice.choose_drafter`` picks the
best); batch-invariance is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from viasd_hf.control.draft_planner import PER_TOKEN_SHARE
from viasd_hf.models.quantization.measure import Measurement

MAX_DRAFTS = 16


def block_throughput(acceptance: float, drafter_cost: float, per_token: float = PER_TOKEN_SHARE) -> float:
    """Committed tokens per verifying pass's worth of time, at the best number of drafts per block."""
    best = 0.0
    for drafts in range(1, MAX_DRAFTS + 1):
        committed = sum(acceptance**j for j in range(drafts + 1))
        best = max(best, committed / (drafts * drafter_cost + 1 + per_token * (drafts + 1)))
    return best


def drafting_throughput(m: Measurement) -> float:
    return block_throughput(m.top1, m.judge_bytes * m.decode_ratio)


@dataclass(frozen=True)
class DraftingAcceptance:
    """When ``auto`` may pick a quantised drafter: it must make its target decode ``min_speedup`` times as fast as
    the bf16 drafter does (a smaller gain is within run-to-run noise)."""

    min_speedup: float = 1.05

    def rejects(self, m: Measurement, baseline: Measurement) -> str | None:
        if m.error:
            return m.error
        gain = drafting_throughput(m) / drafting_throughput(baseline)
        if gain < self.min_speedup:
            return f"its target decodes {gain:.2f}× as fast as with the bf16 drafter < {self.min_speedup}×"
        return None

