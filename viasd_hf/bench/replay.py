"""Replay recorded calls on other pass costs: what each method's speed would be where passes cost that.

A call's projected seconds are the sum of its traced passes (:mod:`viasd_hf.bench.traces`), each
priced from a costs file (:mod:`viasd_hf.bench.pass_costs`), plus the decoding loop's own work between
them: where the costs file measured the method's loop on its device (per target pass,
:mod:`viasd_hf.bench.loop_costs`), that times the call's target passes; else the seconds the call
spent outside every pass, as recorded. Prices between grid points are interpolated linearly in the tokens fed and the cache
length; a routed pass is priced from the full pass and the cost per layer. The self-check: replayed
on costs measured on the machine that recorded the traces, each method's projected speed must come
within 10 % of its measured one.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from viasd_hf.bench.traces import CallTrace, Pass

SELF_CHECK_TOLERANCE = 0.10


def _between(points: list[int], value: float) -> tuple[int, int, float]:
    """Indexes of the grid points around ``value`` and its weight on the upper one (linear beyond either end)."""
    if len(points) == 1:
        return 0, 0, 0.0
    upper = min(max(bisect.bisect_left(points, value), 1), len(points) - 1)
    lower = upper - 1
    return lower, upper, (value - points[lower]) / (points[upper] - points[lower])


class ModelCosts:
    """One model's measured body and head costs, priced at any pass."""

    def __init__(self, key: str, measured: dict[str, list[dict]]) -> None:
        self.key = key
        self.body = {(row["context"], row["width"]): row for row in measured["body"]}
        self.contexts = sorted({context for context, _ in self.body})
        self.widths = {c: sorted(w for context, w in self.body if context == c) for c in self.contexts}
        self.heads: dict[int, dict[int, float]] = defaultdict(dict)
        for row in measured["head"]:
            self.heads[row["vocab"]][row["rows"]] = row["seconds"]

    def _body_at(self, context: int, width: float, layers: int) -> float:
        widths = self.widths[context]
        lo, hi, t = _between(widths, width)
        priced = []
        for w in (widths[lo], widths[hi]):
            row = self.body[(context, w)]
            if layers < row["layers"] and row["per_layer"] is None:
                raise KeyError(f"the costs of {self.key} hold no routed passes: measure them on these traces")
            priced.append(row["full"] - (row["layers"] - layers) * (row["per_layer"] or 0.0))
        return max(priced[0] + t * (priced[1] - priced[0]), 0.0)

    def price(self, p: Pass) -> float:
        if p.kind == "body":
            if not self.contexts:
                raise KeyError(f"the costs hold no body passes of {self.key}")
            decoding = [c for c in self.contexts if c > 0]  # a prompt's pass (no context) is priced from its own grid
            contexts = decoding if p.context > 0 and decoding else self.contexts
            lo, hi, t = _between(contexts, p.context)
            low = self._body_at(contexts[lo], p.width * p.batch, p.layers)
            high = self._body_at(contexts[hi], p.width * p.batch, p.layers)
            return max(low + t * (high - low), 0.0)
        by_rows = self.heads.get(p.vocab)
        if not by_rows:
            raise KeyError(f"the costs hold no head of {self.key} with {p.vocab} rows of vocabulary")
        if p.width in by_rows:
            return by_rows[p.width]
        points = sorted(by_rows)
        lo, hi, t = _between(points, p.width)
        low, high = by_rows[points[lo]], by_rows[points[hi]]
        return max(low + t * (high - low), 0.0)


@dataclass
class MethodReplay:
    """One method over every traced call: measured seconds, traced passes' seconds, projected seconds."""

    method: str
    new_tokens: int = 0
    measured: float = 0.0
    loop: float = 0.0
    projected: float = 0.0
    projected_loop: float = 0.0

    @property
    def measured_tokens_per_s(self) -> float:
        return self.new_tokens / self.measured

    @property
    def projected_tokens_per_s(self) -> float:
        return self.new_tokens / self.projected

    @property
    def error(self) -> float:
        """Projected speed relative to measured speed, minus one (the self-check on the recording machine)."""
        return self.projected_tokens_per_s / self.measured_tokens_per_s - 1.0


def replay(calls: list[CallTrace], costs: dict[str, Any]) -> dict[str, MethodReplay]:
    """Every method's measured and projected totals, in the order the trace first ran them."""
    priced = {key: ModelCosts(key, measured) for key, measured in costs["models"].items()}
    missing = sorted({p.model for call in calls for p in call.passes} - set(priced))
    if missing:
        raise KeyError(f"the costs file holds no costs for {', '.join(missing)}: measure them on this trace "
                       "(`viasd replay TRACES --measure-costs FILE`)")
    loops = costs.get("loop", {})
    methods: dict[str, MethodReplay] = {}
    for call in calls:
        method = methods.setdefault(call.method, MethodReplay(call.method))
        method.new_tokens += call.new_tokens
        method.measured += call.seconds
        method.loop += call.loop_seconds
        loop = projected_loop(call, loops)
        method.projected_loop += loop
        method.projected += loop + sum(priced[p.model].price(p) for p in call.passes)
    return methods


def projected_loop(call: CallTrace, loops: dict[str, dict]) -> float:
    """The loop's seconds of a call where the passes cost the costs file's: per target pass as measured there
    (:mod:`viasd_hf.bench.loop_costs`) where it measured this method's loop, else as recorded."""
    measured = loops.get(call.method)
    return call.loop_seconds if measured is None else measured["per_target_pass"] * call.target_passes


def replay_markdown(methods: dict[str, MethodReplay], costs: dict[str, Any]) -> str:
    """A table: measured and projected tokens/s per method, each × greedy, and the self-check's error."""
    greedy = methods.get("greedy")
    lines = [
        f"Projected on {costs.get('device', '?')} (torch {costs.get('torch', '?')}):",
        "",
        "| method | measured tokens/s | × greedy | loop share | projected tokens/s | × greedy | loop share | "
        "projected ÷ measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method in methods.values():
        measured_ratio = method.measured_tokens_per_s / greedy.measured_tokens_per_s if greedy else float("nan")
        projected_ratio = method.projected_tokens_per_s / greedy.projected_tokens_per_s if greedy else float("nan")
        lines.append(
            f"| {method.method} | {method.measured_tokens_per_s:.2f} | {measured_ratio:.2f} | "
            f"{method.loop / method.measured:.0%} | {method.projected_tokens_per_s:.2f} | {projected_ratio:.2f} | "
            f"{method.projected_loop / method.projected:.0%} | {1 + method.error:.2f} |"
        )
    return "\n".join(lines)


def self_check(methods: dict[str, MethodReplay], tolerance: float = SELF_CHECK_TOLERANCE) -> list[str]:
    """The methods whose projected speed misses the measured one by more than ``tolerance`` (costs measured where the
    traces were recorded)."""
    return [f"{m.method}: projected {m.projected_tokens_per_s:.2f} tokens/s, measured {m.measured_tokens_per_s:.2f}"
            for m in methods.values() if abs(m.error) > tolerance]


def median_pass_error(calls: list[CallTrace], costs: dict[str, Any]) -> dict[str, float]:
    """Per traced model and kind: the median of priced ÷ recorded seconds over its passes (where projections miss)."""
    priced = {key: ModelCosts(key, measured) for key, measured in costs["models"].items()}
    ratios: dict[str, list[float]] = defaultdict(list)
    for call in calls:
        for p in call.passes:
            if p.seconds > 0 and p.model in priced:
                ratios[f"{p.model} {p.kind}"].append(priced[p.model].price(p) / p.seconds)
    return {key: statistics.median(values) for key, values in sorted(ratios.items())}
