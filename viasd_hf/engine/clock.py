"""Where the decode loop's seconds come from: every timing that steers a decision (the speculation switch, the draft
planner, the tier controller) is read from one ``Clock`` per call, so a test can drive those decisions with a fake
clock and ranks of a sharded target can agree on one clock's readings."""

from __future__ import annotations

import time


class Clock:
    """Seconds as ``time.perf_counter`` counts them."""

    def now(self) -> float:
        return time.perf_counter()

    def since(self, started: float) -> float:
        """The seconds from ``started`` (a reading of ``now``) to now."""
        return self.now() - started


def call_clock(model: object) -> Clock:
    """The clock a call on ``model`` reads its seconds from."""
    return Clock()
