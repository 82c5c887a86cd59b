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


@dataclass
class FadedSpread(FadedMean):
    """A faded mean of counts, each of weight one, that knows how far to trust it: how many counts it rests on, the
    older ones weighing less (``blocks``), and the standard error of its mean (``relative_error``)."""

    squares: float = 0.0  # Σ count², faded
    weights_squared: float = 0.0  # Σ weight², faded twice over: what ``blocks`` divides by

    def fade(self, decay: float) -> None:
        super().fade(decay)
        self.squares *= decay
        self.weights_squared *= decay * decay

    def add(self, amount: float, weight: float = 1.0) -> None:
        super().add(amount, weight)
        self.squares += amount * amount
        self.weights_squared += weight * weight

    def blocks(self) -> float:
        """How many counts the mean rests on: (Σ weight)² / Σ weight², the faded ones counting as fractions."""
        return self.weight * self.weight / self.weights_squared if self.weights_squared > 0 else 0.0

    def relative_error(self) -> float | None:
        """The standard error of the mean over the mean, from the counts' own spread; ``None`` before any count."""
        mean = self.mean()
        if not mean or not self.blocks():
            return None
        variance = max(self.squares / self.weight - mean * mean, 0.0)
        return (variance / self.blocks()) ** 0.5 / mean
