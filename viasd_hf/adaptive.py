"""Online control of the tiers: run the slim tier only while it pays (draft lengths: ``draft_planner.py``).

Whether the slim tier pays depends on the machine, the mask and the text, so instead of
predicting, the controller measures and uses the cheaper regime — slim tier on or off — and now
and then probes the other one, so a change of text or load is noticed. Every switch is recorded
with its reason. What "measures" means depends on the mode:

- **tiered**: a slim block saves the full pass unless it escalates, so the two regimes are
  compared by their measured throughput (``WallClock``).
- **lossless**: the full model verifies every block anyway; the slim tier only adds a pass, and
  adds at most one token — a repaired draft the full model keeps. So every block measures the
  two-tier cost (its seconds and tokens less the slim tier's share), and slim blocks measure
  the slim pass and what its repairs gained (``RepairLedger``). Comparing those is far less noisy
  than comparing wall time of blocks of one to sixteen tokens, and when even a kept repair in
  every block could not pay for the slim pass, there is nothing to probe.

A probe of the losing regime costs time, so the interval between probes doubles each time a
probe confirms the current choice (up to ``max_probe_every``) and resets on a switch: the
price of staying alert tends to nothing while the choice stays right, which is what "never
slower than plain two-tier decoding" needs when the slim tier does not pay.

Measurements persist across ``generate`` calls on the same model, mask and drafter (as HF keeps
its assistant's confidence threshold), so short generations do not pay the warm-up every time;
they live where the user can see and reset them (``tier_memory.TierMemory``).
The starting choice is the mask's own offline prediction (DIMR's insertion criterion) in tiered
mode, and off in lossless mode. A switch needs evidence beyond the measurements' noise, and a
switch to the slim tier a clear margin as well: two-tier decoding is the safe choice.

Timings make runs differ. Whether the slim tier runs changes the output in tiered mode (tokens it
commits are its own) and when sampling (it changes the proposal the full model verifies and which
random numbers are drawn); only lossless greedy output is the full model's own whatever it does.
So ``ViaSDConfig.tier_switching`` chooses: ``"measured"`` (this controller), ``"fixed"``
(``FixedChoice``: its starting choice, kept for the whole call, so seeded calls are reproducible),
or ``"auto"``: measured exactly where the choice cannot change the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from .masks import RoutingMask


@dataclass
class BlockCost:
    """What one block cost and committed, as the controller sees it."""

    slim: bool  # the regime the block is charged to
    seconds: float
    tokens: int
    slim_seconds: float = 0.0  # of ``seconds``, spent in the slim pass
    full_seconds: float = 0.0  # of ``seconds``, spent in full passes
    repair_gain: int = 0  # lossless: tokens the slim tier's repair added to the block (−1, 0 or 1)


@dataclass
class Regime:
    """Faded sums of seconds, committed tokens and blocks, and what their spread needs.

    Seconds over tokens is a throughput. A decayed mean of per-block ratios would not be: blocks
    that commit one token would weigh as much as blocks that commit sixteen, which favours
    whichever regime has the steadier block sizes rather than the faster one. Blocks commit one
    to sixteen tokens, so a few of them say little: the sums of squares (faded by ``decay²``, as
    the squared weights fade) give the throughput's standard error.
    """

    seconds: float = 0.0
    tokens: float = 0.0
    blocks: float = 0.0
    seconds_sq: float = 0.0
    tokens_sq: float = 0.0
    seconds_tokens: float = 0.0
    blocks_sq: float = 0.0

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None

    @property
    def seconds_per_token_error(self) -> float:
        """Standard error of ``seconds_per_token`` (delta method for a ratio of weighted sums); infinite
        until there are two blocks' worth of measurements."""
        rate = self.seconds_per_token
        effective_blocks = self.blocks**2 / self.blocks_sq if self.blocks_sq else 0.0
        if rate is None or effective_blocks <= 1.0 + 1e-9:
            return float("inf")
        spread = self.seconds_sq - 2 * rate * self.seconds_tokens + rate**2 * self.tokens_sq
        unbiased = max(spread, 0.0) * effective_blocks / (effective_blocks - 1)
        return unbiased**0.5 / self.tokens

    @property
    def seconds_per_block(self) -> float | None:
        return self.seconds / self.blocks if self.blocks else None

    @property
    def tokens_per_block(self) -> float | None:
        return self.tokens / self.blocks if self.blocks else None

    def observe(self, seconds: float, tokens: float) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.blocks += 1
        self.seconds_sq += seconds**2
        self.tokens_sq += tokens**2
        self.seconds_tokens += seconds * tokens
        self.blocks_sq += 1

    def fade(self, decay: float) -> None:
        """Age what was measured by one block: the ratios and their errors stay, but new blocks outweigh old ones."""
        self.seconds *= decay
        self.tokens *= decay
        self.blocks *= decay
        self.seconds_sq *= decay**2
        self.tokens_sq *= decay**2
        self.seconds_tokens *= decay**2
        self.blocks_sq *= decay**2


class SlimEstimate(Protocol):
    """What the slim tier does to seconds per committed token, as measured so far."""

    def observe(self, block: BlockCost, decay: float) -> None: ...

    def cost_ratio(self) -> tuple[float, float] | None:
        """Seconds per token with the slim tier over seconds per token without it, as the range the
        measurements allow (``None``: not measured yet)."""

    def best_case_ratio(self) -> float | None:
        """The lowest ``cost_ratio`` the slim tier could reach here (``None``: no bound known)."""

    def describe(self) -> str: ...


@dataclass
class WallClock:
    """Tiered mode: each regime's measured throughput, drafting included, within ``z`` standard errors."""

    on: Regime = field(default_factory=Regime)
    off: Regime = field(default_factory=Regime)
    z: float = 2.5

    def observe(self, block: BlockCost, decay: float) -> None:
        self.on.fade(decay)
        self.off.fade(decay)
        (self.on if block.slim else self.off).observe(block.seconds, block.tokens)

    def cost_ratio(self) -> tuple[float, float] | None:
        on, off = self.on.seconds_per_token, self.off.seconds_per_token
        if on is None or not off:
            return None
        relative_error = math.hypot(self.on.seconds_per_token_error / on, self.off.seconds_per_token_error / off)
        spread = math.exp(min(self.z * relative_error, 50.0))  # on the log scale, where a ratio's errors add
        return on / off / spread, on / off * spread

    def best_case_ratio(self) -> float | None:
        return None

    def describe(self) -> str:
        on, off = self.on, self.off
        return (
            f"{on.seconds_per_token * 1000:.1f} ± {on.seconds_per_token_error * 1000:.1f} ms/token with the slim tier "
            f"vs {off.seconds_per_token * 1000:.1f} ± {off.seconds_per_token_error * 1000:.1f} ms/token without"
        )


@dataclass
class RepairLedger:
    """Lossless mode: the two-tier cost, measured on every block, against the slim pass and what its repairs gain.

    A block with the slim tier costs ``B + S`` seconds for ``T + g`` tokens, where ``B`` and ``T``
    are what drafting and full verification cost and commit (every block measures them) and
    ``S`` and ``g`` the slim pass and its repair gain (slim blocks measure them). The slim tier
    pays iff ``g / T > S / B``; since ``g <= 1``, it cannot pay at all once ``S / B >= 1 / T``.
    Until a slim pass has been timed, ``S`` is taken as the kept layers' share of a full pass —
    less than it costs, as the embeddings and LM head still run — so that bound holds from the
    first block and a slim tier that cannot pay is never run.
    """

    kept_fraction: float = 1.0  # of the target's layers that the slim pass runs
    base: Regime = field(default_factory=Regime)
    repairs: Regime = field(default_factory=Regime)  # seconds: slim passes; tokens: repair gains
    full_seconds: float = 0.0  # faded like ``base``: the full passes' share of its seconds

    def observe(self, block: BlockCost, decay: float) -> None:
        self.base.fade(decay)
        self.repairs.fade(decay)
        self.full_seconds = decay * self.full_seconds + block.full_seconds
        self.base.observe(block.seconds - block.slim_seconds, block.tokens - block.repair_gain)
        if block.slim:
            self.repairs.observe(block.slim_seconds, block.repair_gain)

    def _ratio(self, slim_seconds: float | None, gain: float | None) -> float | None:
        seconds, tokens = self.base.seconds_per_block, self.base.tokens_per_block
        if gain is None or slim_seconds is None or not seconds or not tokens:
            return None
        return (1 + slim_seconds / seconds) / (1 + gain / tokens)

    def cost_ratio(self) -> tuple[float, float] | None:
        ratio = self._ratio(self.repairs.seconds_per_block, self.repairs.tokens_per_block)
        return None if ratio is None else (ratio, ratio)

    def best_case_ratio(self) -> float | None:
        slim_seconds = self.repairs.seconds_per_block
        if slim_seconds is None and self.base.blocks:
            slim_seconds = self.kept_fraction * self.full_seconds / self.base.blocks
        return self._ratio(slim_seconds, 1.0)

    def describe(self) -> str:
        base, repairs = self.base, self.repairs
        return (
            f"slim pass {repairs.seconds_per_block * 1000:.1f} ms for {repairs.tokens_per_block:+.2f} tokens per block "
            f"vs {base.seconds_per_block * 1000:.1f} ms for {base.tokens_per_block:.2f} tokens without it"
        )


@dataclass
class TierController:
    """Chooses, block by block, whether the slim tier runs; probes the other choice with a backing-off interval.

    A probe runs the other regime until it has committed ``probe_tokens`` tokens (or for
    ``max_probe_blocks`` blocks): a few blocks of one to sixteen tokens each are too noisy to act
    on, and a wrong switch costs far more than a late one. The decision is taken when the probe
    ends; between probes, the current regime is compared with what the last probe measured. A
    probe of the slim tier is skipped (and the interval backs off) when the estimate says it
    cannot win by the margin even at best.
    """

    slim_on: bool = True  # the starting choice
    estimate: SlimEstimate = field(default_factory=WallClock)
    first_probe: int = 8  # the regime the prior did not pick is measured early, once
    probe_every: int = 32  # blocks between probes after a switch; doubles while probes confirm the choice
    max_probe_every: int = 256
    probe_tokens: int = 32
    max_probe_blocks: int = 8
    decay: float = 0.9  # per block: a probe's blocks outweigh what was measured long ago
    margin: float = 0.10  # the slim tier is switched on only when cheaper by more than this fraction
    block: int = 0
    switches: list[dict] = field(default_factory=list)
    probe_interval: int = 0  # current blocks between probes (0: not started)
    next_probe: int = 0  # block at which the next probe starts
    probed_tokens: int = 0
    probed_blocks: int = 0

    def __post_init__(self) -> None:
        self.probe_interval = self.probe_interval or self.probe_every
        self.next_probe = self.next_probe or self.first_probe

    @property
    def probing(self) -> bool:
        return self.block >= self.next_probe

    def use_slim(self) -> bool:
        """Whether the next block runs the slim tier."""
        if self.probing and not self.slim_on and not self.probed_blocks and not self._slim_could_win():
            self._back_off()  # probing a slim tier that cannot win even at best would only cost time
        return not self.slim_on if self.probing else self.slim_on

    def observe(self, block: BlockCost) -> None:
        """Record a finished block; at the end of a probe, or whenever the current regime falls clearly
        behind what the other one last measured, switch."""
        probing = self.probing
        self.estimate.observe(block, self.decay)
        self.block += 1
        if not probing:
            if self._other_is_cheaper():
                self._switch()
            return
        self.probed_blocks += 1
        if block.slim != self.slim_on:  # not a block that paid the current regime's debt
            self.probed_tokens += block.tokens
        if self.probed_tokens < self.probe_tokens and self.probed_blocks < self.max_probe_blocks:
            return
        self.probed_tokens = self.probed_blocks = 0
        if self._other_is_cheaper():
            self._switch()
        else:
            self._back_off()

    def _slim_could_win(self) -> bool:
        best = self.estimate.best_case_ratio()
        return best is None or best < 1 - self.margin

    def _other_is_cheaper(self) -> bool:
        """Whether the measurements show, beyond their noise, the slim tier costlier (when on) or cheaper by the
        margin (when off)."""
        ratio = self.estimate.cost_ratio()
        if ratio is None:
            return False
        low, high = ratio
        return low > 1 if self.slim_on else high < 1 - self.margin

    def _back_off(self) -> None:
        """A probe confirmed the current choice (or could not change it): wait twice as long before the next one."""
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
        self.next_probe = self.block + self.probe_interval

    def _switch(self) -> None:
        self.slim_on = not self.slim_on
        self.probe_interval = self.probe_every
        self.next_probe = self.block + self.probe_interval
        self.switches.append({
            "block": self.block,
            "slim_tier": "on" if self.slim_on else "off",
            "reason": self.estimate.describe(),
        })


def predicted_to_pay(mask: RoutingMask) -> bool:
    """Whether the mask's DIMR search predicted the slim tier to pay (insertion criterion Δ > 0 and a
    predicted speed-up above 1); masks without that record are given the benefit of the doubt."""
    delta = mask.metadata.get("insertion", {}).get("delta")
    speedup = mask.metadata.get("predicted_speedup")
    return not ((delta is not None and delta <= 0) or (speedup is not None and speedup < 1))


def new_controller(mask: RoutingMask, lossless: bool) -> TierController:
    """A controller that has measured nothing yet.

    A tiered one starts from the mask's offline prediction, a lossless one with the slim tier off
    (its repairs add at most one token per block, for a whole slim pass); measurements then decide.
    """
    slim_on = starts_with_slim_tier(mask, lossless)
    if lossless:
        return TierController(slim_on=slim_on, estimate=RepairLedger(len(mask.kept_layers) / mask.num_layers))
    return TierController(slim_on=slim_on, estimate=WallClock())


def starts_with_slim_tier(mask: RoutingMask, lossless: bool) -> bool:
    """The choice before anything is measured: the mask's offline prediction in tiered mode; off in
    lossless mode, where a repair adds at most one token per block for a whole slim pass."""
    return not lossless and predicted_to_pay(mask)


def measures_wall_clock(tier_switching: str, lossless: bool, do_sample: bool) -> bool:
    """Whether the slim tier's on/off choice goes to the wall-clock controller (else to ``FixedChoice``).

    ``"auto"`` hands it over only in lossless greedy decoding: there the full model's argmax picks
    every token, so the choice changes the speed but not the output.
    """
    if tier_switching == "auto":
        return lossless and not do_sample
    return tier_switching == "measured"


@dataclass
class FixedChoice:
    """``tier_switching="fixed"``: the slim tier runs on every block or on none, as a new controller would start.

    That is the mask's offline prediction in tiered mode and off in lossless mode (see
    ``new_controller``), decided from the mask alone, so neither timings nor earlier calls can
    change a seeded call's output. It answers the decoder as a ``TierController`` does.
    """

    slim_on: bool
    switches: list[dict] = field(default_factory=list)  # stays empty

    @classmethod
    def for_mask(cls, mask: RoutingMask, lossless: bool) -> FixedChoice:
        return cls(slim_on=starts_with_slim_tier(mask, lossless))

    def use_slim(self) -> bool:
        return self.slim_on

    def observe(self, block: BlockCost) -> None:
        """Nothing measured changes a fixed choice."""
