"""When an online choice tries the option it is not using: a probe schedule that backs off while probes agree.

Every measured choice of the decoder (plain decoding or speculation, ``speculation_switch``) keeps using
what measured best and now and then probes the alternative, so that a change of text or load is
noticed. A probe costs time when the choice was right, so the interval between probes doubles
each time a probe confirms the choice (up to ``longest``) and resets on a switch: the price of
staying alert tends to nothing while the choice stays right.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProbeSchedule:
    """Probes start at step ``first``, then every ``interval`` steps (``every`` after a switch, doubling up to
    ``longest`` while probes confirm the choice)."""

    first: int = 4
    every: int = 16
    longest: int = 256
    interval: int = 0  # steps between probes now (0: not started)
    due_at: int = 0  # the step at which the next probe starts

    def __post_init__(self) -> None:
        self.interval = self.interval or self.every
        self.due_at = self.due_at or self.first

    def due(self, step: int) -> bool:
        """Whether step ``step`` belongs to a probe."""
        return step >= self.due_at

    def confirmed(self, step: int, at_least: int = 0) -> None:
        """A probe ending at ``step`` confirmed the choice: wait twice as long for the next one (and ``at_least``
        steps, up to ``longest``: a probe that costs much waits longer)."""
        self.interval = min(max(2 * self.interval, at_least), self.longest)
        self.due_at = step + self.interval

    def switched(self, step: int, at_least: int = 0) -> None:
        """The choice changed at ``step``, or a probe ending there left it in doubt: probe again soon (after
        ``at_least`` steps, up to ``longest``), and double from there."""
        self.interval = min(max(self.every, at_least), self.longest)
        self.due_at = step + self.interval
