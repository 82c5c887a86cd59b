"""Faded means: what the online choices measure, each new observation outweighing the older ones.

Every measured choice (the tier controller's pass prices, the speculation switch, hybrid drafting,
the draft planner) follows the text being decoded, so what was measured long ago must count less
than what was measured just now. ``FadedMean`` keeps two sums, of amounts and of their weights,
both multiplied by ``decay`` at each ``fade``; its mean is a ratio of the two. A throughput is one
(tokens added with seconds as their weight): a mean of per-block ratios would let a block of one
token weigh as much as a block of sixteen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FadedMean:
    """Σ amount / Σ weight over what was added, each ``fade(decay)`` making what came before count ``decay`` times less."""

    total: float = 0.0  # Σ amount, faded
    weight: float = 0.0  # Σ weight, faded

    def fade(self, decay: float) -> None:
        self.total *= decay
        self.weight *= decay

    def add(self, amount: float, weight: float = 1.0) -> None:
        """``amount`` measured over ``weight`` (a value: weight 1; tokens over seconds: weight the seconds)."""
        self.total += amount
        self.weight += weight

    def observe(self, amount: float, decay: float, weight: float = 1.0) -> None:
        """Fade what was measured by ``decay``, then add ``amount`` over ``weight``."""
        self.fade(decay)
        self.add(amount, weight)

    def mean(self, prior: float = 0.0, prior_weight: float = 0.0) -> float | None:
        """Σ amount / Σ weight, ``prior`` counting as ``prior_weight`` more weight; ``None`` while there is no weight."""
        weight = self.weight + prior_weight
        return (self.total + prior * prior_weight) / weight if weight > 0 else None
