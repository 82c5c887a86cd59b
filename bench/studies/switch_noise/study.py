"""How much throughput the speculation switch keeps where speculation pays a little, blocks drafting by chance.

Drives ``SpeculationSwitch()`` with simulated blocks: a speculative block commits 1 to 6 tokens (a 5-token chain draft,
each draft token accepted with chance 0.7), costing what makes speculation ``speedup`` times plain decoding's 0.2 s a
token; every block's seconds vary 10 % either way. ``bursty``: the bench's ``--load bursty`` schedule
(``viasd_hf.bench.load.BURSTY``) halves the machine's speed while a burst is on. Prints, per speedup, the median and
the worst over seeds of the tokens per second decoded over those of the better regime kept throughout, on the same
blocks and load. Nothing is timed: it runs in seconds, and at any commit whose switch takes ``observe(speculated,
tokens, seconds)``.

    python bench/studies/switch_noise/study.py
"""

from __future__ import annotations

import random
import sys
from statistics import median

from viasd_hf.bench.load import BURSTY, phase
from viasd_hf.control.speculation_switch import SpeculationSwitch

PLAIN_SECONDS, MEAN_TOKENS, BLOCKS, SEEDS = 0.2, 2.94, 500, 10


def loaded(start: float, seconds: float, slowdown: float) -> float:
    """The seconds ``seconds`` of work take from ``start`` on, the bursty load's bursts running it ``slowdown`` times
    slower."""
    now, left = start, seconds
    while left > 1e-12:
        on, until_change = phase(BURSTY, now)
        rate, span = (1 / slowdown if on else 1.0), max(until_change, 1e-9)
        if left <= span * rate:
            return now + left / rate - start
        left, now = left - span * rate, now + span
    return now - start


def throughput(choose, speedup: float, slowdown: float, seed: int) -> float:
    """Tokens per second over ``BLOCKS`` blocks, ``choose`` (a switch, or a fixed regime) picking each block's regime."""
    draws, start = random.Random(seed), random.Random(-seed).uniform(0, 5)
    now, tokens = start, 0
    for _ in range(BLOCKS):
        speculated = choose.speculates()
        accepted = 0
        while speculated and accepted < 5 and draws.random() < 0.7:
            accepted += 1
        work = (MEAN_TOKENS * PLAIN_SECONDS / speedup if speculated else PLAIN_SECONDS) * draws.uniform(0.9, 1.1)
        seconds = loaded(now, work, slowdown)
        choose.observe(speculated, accepted + 1 if speculated else 1, seconds)
        now, tokens = now + seconds, tokens + (accepted + 1 if speculated else 1)
    return tokens / (now - start)


class Kept:
    """One regime throughout."""

    def __init__(self, speculating: bool) -> None:
        self.speculating = speculating

    def speculates(self) -> bool:
        return self.speculating

    def observe(self, *measured) -> None:
        pass


def main() -> None:
    print("speedup  load    kept: median  worst")
    for slowdown, load in ((1.0, "none"), (2.0, "bursty")):
        for speedup in (0.9, 1.1, 1.2, 1.35, 1.5, 2.0):
            kept = [throughput(SpeculationSwitch(), speedup, slowdown, seed)
                    / max(throughput(Kept(regime), speedup, slowdown, seed) for regime in (True, False))
                    for seed in range(SEEDS)]
            print(f"{speedup:7.2f}  {load:6}  {median(kept):12.3f}  {min(kept):5.3f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
