"""What the adaptive controller measures: block costs, and each mode's estimate of what the slim tier saves.

``PricedBlocks`` (tiered mode) compares the two regimes' blocks priced at the same, latest pass
costs and bounds the slim tier's best case by its pass cost; ``RepairLedger`` (lossless mode)
prices the slim pass against the tokens its repairs add. ``tier_controller.TierController`` acts on
either through ``SlimEstimate``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Protocol

from viasd_hf.control.faded import FadedMean
from viasd_hf.control.speculation_switch import PAIR_DISTANCE


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
    drafter_seconds: float = 0.0  # of ``seconds``, spent in the drafter's passes
    drafter_passes: int = 0

    @property
    def other_seconds(self) -> float:
        """Seconds outside any pass: copying drafts, committing, bookkeeping."""
        return self.seconds - self.slim_seconds - self.full_seconds - self.drafter_seconds

    def pass_costs(self) -> dict[str, tuple[float, int]]:
        """Seconds and count of each kind of pass the block ran."""
        return {"drafter": (self.drafter_seconds, self.drafter_passes), "slim": (self.slim_seconds, int(self.slim_seconds > 0)),
                "full": (self.full_seconds, int(self.full_seconds > 0))}


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


PASSES = ("drafter", "slim", "full")  # the passes a block is counted in, besides its other seconds


@dataclass
class Prices:
    """Seconds per drafter, slim and full pass, from evidence a burst of load cannot fake for long, whichever regime
    ran them: a full pass at the median of the latest ``kept``, a drafter or slim pass at the median of its latest
    ratios to a full pass measured close together (the same block, or at most ``PAIR_DISTANCE`` blocks before) times
    that. A burst slows both passes of a ratio, which then stands, or spoils a few, which the median passes over.

    They follow the text being decoded (a long context makes every pass dearer, for both regimes at once); a pass
    that has not run for a while keeps the price it was last measured at. A pass never measured near a full one is
    priced at the faded mean of its seconds (``seconds``).
    """

    kept: int = 15
    seconds: dict[str, FadedMean] = field(default_factory=lambda: {name: FadedMean() for name in PASSES})
    full: deque[float] = field(init=False)  # the latest full passes' seconds
    ratios: dict[str, deque[float]] = field(init=False)  # drafter and slim passes over a full pass close together
    latest_full: tuple[int, float] | None = None  # block, seconds
    block: int = 0

    def __post_init__(self) -> None:
        self.full = deque(maxlen=self.kept)
        self.ratios = {name: deque(maxlen=self.kept) for name in ("drafter", "slim")}

    def observe(self, block: BlockCost, decay: float) -> None:
        passes = block.pass_costs()
        for name, (seconds, count) in passes.items():
            if count:
                self.seconds[name].observe(seconds, decay, weight=count)
        full_seconds, full_count = passes["full"]
        if full_count and full_seconds > 0:
            self.latest_full = (self.block, full_seconds / full_count)
            self.full.append(full_seconds / full_count)
        if self.latest_full is not None and self.block - self.latest_full[0] <= PAIR_DISTANCE:
            for name, ratios in self.ratios.items():
                seconds, count = passes[name]
                if count and seconds > 0:
                    ratios.append(seconds / count / self.latest_full[1])
        self.block += 1

    def of(self, name: str) -> float | None:
        if self.full and (name == "full" or self.ratios[name]):
            return median(self.full) * (1.0 if name == "full" else median(self.ratios[name]))
        return self.seconds[name].mean()


@dataclass
class PassCounts:
    """One regime's blocks as counts of passes: faded sums of ``x`` = (other seconds, drafter passes, slim passes,
    full passes), of the tokens, and of their products, so that the blocks can be priced at any prices ``p``
    (seconds = p·x, with p = (1, drafter, slim, full)) with the spread a throughput's standard error needs."""

    regime: Regime = field(default_factory=Regime)  # tokens and blocks; its seconds are unused
    x: list[float] = field(default_factory=lambda: [0.0] * 4)
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    xt: list[float] = field(default_factory=lambda: [0.0] * 4)

    def observe(self, counts: list[float], tokens: float) -> None:
        self.regime.observe(0.0, tokens)
        for i, value in enumerate(counts):
            self.x[i] += value
            self.xt[i] += value * tokens
            for j, other in enumerate(counts):
                self.xx[i][j] += value * other

    def fade(self, decay: float) -> None:
        self.regime.fade(decay)
        for i in range(4):
            self.x[i] *= decay
            self.xt[i] *= decay**2
            for j in range(4):
                self.xx[i][j] *= decay**2

    def priced(self, prices: list[float]) -> Regime:
        """The regime's seconds, had every block's passes cost ``prices``."""
        dot = sum(p * x for p, x in zip(prices, self.x))
        square = sum(prices[i] * prices[j] * self.xx[i][j] for i in range(4) for j in range(4))
        cross = sum(p * xt for p, xt in zip(prices, self.xt))
        return replace(self.regime, seconds=dot, seconds_sq=square, seconds_tokens=cross)

    def mean(self, index: int) -> float:
        return self.x[index] / self.regime.blocks if self.regime.blocks else 0.0


@dataclass
class PricedBlocks:
    """Tiered mode: each regime's blocks counted in passes and priced at the latest measured pass costs.

    Comparing the regimes' wall time per token would compare blocks decoded at different times: a
    regime last measured on long summaries looks dear next to one measured on short questions, and
    the controller would switch for the text, not the tier. So each regime keeps only what it
    *does* per block — drafter passes, slim passes, full passes (an escalation adds one) and tokens
    committed, plus the few seconds outside any pass — and both are priced at the same, latest
    seconds per pass (``Prices``, measured on every block):

        cost per token = (other + n_drafter·d + n_slim·S + n_full·F) / tokens,

    within ``z`` standard errors (the blocks' spread in passes and tokens). It also prices the slim
    tier's best case, DIMR's insertion criterion measured online: a two-tier block with its full
    pass replaced by one slim pass that never escalates, committing as many tokens as the larger of
    the two regimes' blocks. Until a slim pass is timed, ``S`` is the kept layers' share of ``F`` —
    less than it costs, since the embeddings and the LM head still run — so a slim tier too costly
    even then is never probed.
    """

    kept_fraction: float = 0.0  # of the target's layers the slim pass runs (0: no prior bound)
    on: PassCounts = field(default_factory=PassCounts)
    off: PassCounts = field(default_factory=PassCounts)
    prices: Prices = field(default_factory=Prices)
    z: float = 2.5

    def observe(self, block: BlockCost, decay: float) -> None:
        self.on.fade(decay)
        self.off.fade(decay)
        self.prices.observe(block, decay)
        passes = {name: float(count) for name, (_, count) in block.pass_costs().items()}
        other, drafter = block.other_seconds, passes["drafter"]
        if block.slim_would_commit is None:
            counts = [other, drafter, passes["slim"], passes["full"]]
            (self.on if block.slim else self.off).observe(counts, block.tokens)
            return
        self.off.observe([other, drafter, 0.0, 1.0], block.tokens)
        if block.slim_would_commit:
            self.on.observe([other, drafter, 1.0, 0.0], block.slim_would_commit)
        else:
            self.on.observe([other, drafter, 1.0, 1.0], block.tokens)

    def _price_list(self) -> list[float]:
        """p = (1, drafter, slim, full); a pass no block has run yet is priced 0 (the slim pass: the kept layers' share
        of the full one), which no count multiplies."""
        full = self.prices.of("full") or 0.0
        slim = self.prices.of("slim")
        return [1.0, self.prices.of("drafter") or 0.0, self.kept_fraction * full if slim is None else slim, full]

    def cost_ratio(self) -> tuple[float, float] | None:
        prices = self._price_list()
        on, off = self.on.priced(prices), self.off.priced(prices)
        on_rate, off_rate = on.seconds_per_token, off.seconds_per_token
        if not on_rate or not off_rate:
            return None
        relative_error = math.hypot(on.seconds_per_token_error / on_rate, off.seconds_per_token_error / off_rate)
        spread = math.exp(min(self.z * relative_error, 50.0))  # on the log scale, where a ratio's errors add
        return on_rate / off_rate / spread, on_rate / off_rate * spread

    def best_case_ratio(self) -> float | None:
        prices = self._price_list()
        two_tier_tokens = self.off.regime.tokens_per_block
        if not two_tier_tokens or not self.off.mean(3) or not prices[2]:
            return None
        _, drafter, slim, full = prices
        shared = self.off.mean(0) + self.off.mean(1) * drafter
        slim_tokens = max(self.on.regime.tokens_per_block or 0.0, two_tier_tokens)
        return (shared + slim) / slim_tokens / ((shared + self.off.mean(3) * full) / two_tier_tokens)

    def describe(self) -> str:
        prices = self._price_list()

        def cost(counts: PassCounts) -> str:
            regime = counts.priced(prices)
            if regime.seconds_per_token is None:
                return "not measured"
            return f"{regime.seconds_per_token * 1000:.1f} ± {regime.seconds_per_token_error * 1000:.1f} ms/token"

        passes = ", ".join(f"{name} {self.prices.of(name) * 1000:.1f}" for name in PASSES if self.prices.of(name) is not None)
        return f"{cost(self.on)} with the slim tier vs {cost(self.off)} without (ms per pass: {passes or 'none yet'})"


@dataclass
class RepairLedger:
    """Lossless mode: the two-tier cost, measured on every block, against the slim pass and what its repairs gain.

    A block with the slim tier costs ``B + S`` seconds for ``T + g`` tokens, where ``B`` and ``T``
    are what drafting and full verification cost and commit (every block measures them) and
    ``S`` and ``g`` the slim pass and its repair gain (slim blocks measure them). The slim tier
    pays iff ``g / T > S / B``; since ``g <= 1``, it cannot pay at all once ``S / B >= 1 / T``.
    ``S / B`` is measured within each slim block, whose slim pass and two-tier part run moments apart, and is the
    median of the latest ``kept``: a burst of load slows both, or spoils a few, which the median passes over;
    ``g`` and ``T`` are counts. Until a slim pass has been timed, ``S`` is taken as the kept layers' share of a full
    pass (each block's full pass over its two-tier part, the median likewise) — less than it costs, as the
    embeddings and LM head still run — so that bound holds from the first block and a slim tier that cannot pay is
    never run.
    """

    kept_fraction: float = 1.0  # of the target's layers that the slim pass runs
    kept: int = 15
    base: Regime = field(default_factory=Regime)
    repairs: Regime = field(default_factory=Regime)  # seconds: slim passes; tokens: repair gains
    slim_shares: deque[float] = field(init=False)  # S / B of the latest slim blocks
    full_shares: deque[float] = field(init=False)  # the full pass's share of B, of the latest blocks

    def __post_init__(self) -> None:
        self.slim_shares, self.full_shares = deque(maxlen=self.kept), deque(maxlen=self.kept)

    def observe(self, block: BlockCost, decay: float) -> None:
        self.base.fade(decay)
        self.repairs.fade(decay)
        two_tier = block.seconds - block.slim_seconds
        self.base.observe(two_tier, block.tokens - block.repair_gain)
        if two_tier > 0:
            self.full_shares.append(block.full_seconds / two_tier)
        if block.slim:
            self.repairs.observe(block.slim_seconds, block.repair_gain)
            if two_tier > 0:
                self.slim_shares.append(block.slim_seconds / two_tier)

    def _ratio(self, slim_share: float | None, gain: float | None) -> float | None:
        tokens = self.base.tokens_per_block
        if gain is None or slim_share is None or not tokens:
            return None
        return (1 + slim_share) / (1 + gain / tokens)

    def cost_ratio(self) -> tuple[float, float] | None:
        share = median(self.slim_shares) if self.slim_shares else None
        ratio = self._ratio(share, self.repairs.tokens_per_block)
        return None if ratio is None else (ratio, ratio)

    def best_case_ratio(self) -> float | None:
        if self.slim_shares:
            return self._ratio(median(self.slim_shares), 1.0)
        if self.full_shares:
            return self._ratio(self.kept_fraction * median(self.full_shares), 1.0)
        return None

    def describe(self) -> str:
        base, repairs = self.base, self.repairs
        if base.seconds_per_block is None:
            return "nothing measured yet"
        slim = ("slim pass not measured" if repairs.seconds_per_block is None else
                f"slim pass {repairs.seconds_per_block * 1000:.1f} ms for {repairs.tokens_per_block:+.2f} tokens per block")
        return f"{slim} vs {base.seconds_per_block * 1000:.1f} ms for {base.tokens_per_block:.2f} tokens without it"
