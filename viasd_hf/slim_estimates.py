"""What the adaptive controller measures: block costs, and each mode's estimate of what the slim tier saves.

``WallClock`` (tiered mode) compares the two regimes' throughput and bounds the slim tier's best
case by its pass cost; ``RepairLedger`` (lossless mode) prices the slim pass against the tokens its
repairs add. ``adaptive.TierController`` acts on either through ``SlimEstimate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class BlockCost:
    """What one block cost and committed, as the controller sees it."""

    slim: bool  # the regime the block is charged to
    seconds: float
    tokens: int
    slim_seconds: float = 0.0  # of ``seconds``, spent in the slim pass
    full_seconds: float = 0.0  # of ``seconds``, spent in full passes
    repair_gain: int = 0  # lossless: tokens the slim tier's repair added to the block (−1, 0 or 1)
    slim_would_commit: int | None = None  # a shadow probe (tiered): tokens the slim tier would have committed, 0: escalated


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
    """Tiered mode: each regime's measured throughput, drafting included, within ``z`` standard errors.

    It also prices the slim tier's best case, DIMR's insertion criterion measured online: a block
    with the slim tier costs drafting ``D`` plus the slim pass ``S`` when nothing escalates, where
    a two-tier block costs ``D`` plus the full pass ``F``; what a non-escalated block saves is
    ``F − S``, and escalations only add to ``S``. So the slim tier cannot win once
    ``(D + S) / t_slim`` is no cheaper than ``(D + F) / t_two_tier`` (``t``: tokens per block, the
    slim tier's taken as the larger of the two until its own blocks are measured). Until a slim pass
    is timed, ``S`` is the kept layers' share of ``F`` — less than it costs, since the embeddings and
    the LM head still run — so a slim tier too costly even then is never probed.
    """

    kept_fraction: float = 0.0  # of the target's layers the slim pass runs (0: no prior bound)
    on: Regime = field(default_factory=Regime)
    off: Regime = field(default_factory=Regime)
    drafting: Regime = field(default_factory=Regime)  # seconds: a block's time outside the tiers' passes
    slim_passes: Regime = field(default_factory=Regime)  # seconds per slim pass
    full_passes: Regime = field(default_factory=Regime)  # seconds per block with a full pass
    z: float = 2.5

    def observe(self, block: BlockCost, decay: float) -> None:
        for regime in (self.on, self.off, self.drafting, self.slim_passes, self.full_passes):
            regime.fade(decay)
        if block.slim_would_commit is None:
            (self.on if block.slim else self.off).observe(block.seconds, block.tokens)
        else:
            self.off.observe(block.seconds - block.slim_seconds, block.tokens)
            if block.slim_would_commit:
                self.on.observe(block.seconds - block.full_seconds, block.slim_would_commit)
            else:
                self.on.observe(block.seconds, block.tokens)
        self.drafting.observe(block.seconds - block.slim_seconds - block.full_seconds, 0)
        if block.slim_seconds:
            self.slim_passes.observe(block.slim_seconds, 1)
        if block.full_seconds:
            self.full_passes.observe(block.full_seconds, 1)

    def cost_ratio(self) -> tuple[float, float] | None:
        on, off = self.on.seconds_per_token, self.off.seconds_per_token
        if on is None or not off:
            return None
        relative_error = math.hypot(self.on.seconds_per_token_error / on, self.off.seconds_per_token_error / off)
        spread = math.exp(min(self.z * relative_error, 50.0))  # on the log scale, where a ratio's errors add
        return on / off / spread, on / off * spread

    def best_case_ratio(self) -> float | None:
        draft, full = self.drafting.seconds_per_block, self.full_passes.seconds_per_block
        two_tier_tokens = self.off.tokens_per_block
        if draft is None or full is None or not two_tier_tokens:
            return None
        slim = self.slim_passes.seconds_per_block
        if slim is None:
            if not self.kept_fraction:
                return None
            slim = self.kept_fraction * full
        slim_tokens = max(self.on.tokens_per_block or 0.0, two_tier_tokens)
        return (draft + slim) / slim_tokens / ((draft + full) / two_tier_tokens)

    def describe(self) -> str:
        def cost(regime: Regime) -> str:
            if regime.seconds_per_token is None:
                return "not measured"
            return f"{regime.seconds_per_token * 1000:.1f} ± {regime.seconds_per_token_error * 1000:.1f} ms/token"

        return f"{cost(self.on)} with the slim tier vs {cost(self.off)} without"


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
        if base.seconds_per_block is None:
            return "nothing measured yet"
        slim = ("slim pass not measured" if repairs.seconds_per_block is None else
                f"slim pass {repairs.seconds_per_block * 1000:.1f} ms for {repairs.tokens_per_block:+.2f} tokens per block")
        return f"{slim} vs {base.seconds_per_block * 1000:.1f} ms for {base.tokens_per_block:.2f} tokens without it"
