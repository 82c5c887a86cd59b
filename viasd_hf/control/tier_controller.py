"""Online control of the tiers: run the slim tier only while it pays (draft lengths: ``draft_planner.py``).

Whether the slim tier pays depends on the machine, the mask and the text, so instead of
predicting, the controller measures and uses the cheaper regime — slim tier on or off — and now
and then probes the other one, so a change of text or load is noticed. Every switch is recorded
with its reason. What "measures" means depends on the mode:

- **tiered**: a slim block saves the full pass unless it escalates, so the two regimes are
  compared by their throughput, each regime's blocks priced at the same, latest measured pass
  costs (``PricedBlocks``: what each regime does per block is its own, what a pass costs is the
  text's). While the slim tier is off, it is probed *in shadow* (``policies.shadow_tiered``): the
  slim pass runs and what it would have committed is priced, but the full model decides the
  block, so a probe of a slim tier that does not pay never puts its tokens in the output.
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
they live where the user can see and reset them (``memory.TierMemory``).
The starting choice is the mask's own offline prediction (DIMR's insertion criterion) in tiered
mode, and off in lossless mode. A switch needs evidence beyond the measurements' noise, and a
switch to the slim tier a clear margin as well: two-tier decoding is the safe choice.

Timings make runs differ. Whether the slim tier runs changes the output in tiered mode (tokens it
commits are its own) and when sampling (it changes the proposal the full model verifies and which
random numbers are drawn); only lossless greedy output is the full model's own whatever it does.
So ``ViaSDConfig.reproducible`` chooses: ``False``, this controller; ``True``, ``FixedChoice`` (its starting
choice, kept for the whole call, so seeded calls are reproducible); ``None``, the controller exactly where the
choice cannot change the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from viasd_hf.control.backoff import ProbeSchedule
from viasd_hf.control.cost_ledgers import BlockCost, PricedBlocks, RepairLedger, SlimEstimate
from viasd_hf.masks.routing_mask import RoutingMask


@dataclass
class TierController:
    """Chooses, block by block, whether the slim tier runs; probes the other choice with a backing-off interval.

    A probe runs the other regime until it has committed ``probe_tokens`` tokens (or for
    ``max_probe_blocks`` blocks): a few blocks of one to sixteen tokens each are too noisy to act
    on, and a wrong switch costs far more than a late one. The decision is taken when the probe
    ends; between probes, the current regime is compared with what the last probe measured. A
    probe of the slim tier is skipped (and the interval backs off) when the estimate says it
    cannot win by the margin even at best. With ``shadow_probes`` (tiered mode), a probe of the
    slim tier runs in shadow (``probes_in_shadow``).
    """

    slim_on: bool = True  # the starting choice
    estimate: SlimEstimate = field(default_factory=PricedBlocks)
    first_probe: int = 8  # the regime the prior did not pick is measured early, once
    probe_every: int = 32  # blocks between probes after a switch; doubles while probes confirm the choice
    max_probe_every: int = 256
    probe_tokens: int = 32
    max_probe_blocks: int = 8
    decay: float = 0.9  # per block: a probe's blocks outweigh what was measured long ago
    margin: float = 0.10  # the slim tier is switched on only when cheaper by more than this fraction
    shadow_probes: bool = False  # probe the slim tier without committing its tokens (tiered mode)
    block: int = 0
    switches: list[dict] = field(default_factory=list)
    probed_tokens: int = 0
    probed_blocks: int = 0
    schedule: ProbeSchedule = field(init=False)  # counts blocks

    def __post_init__(self) -> None:
        self.schedule = ProbeSchedule(first=self.first_probe, every=self.probe_every, longest=self.max_probe_every)

    @property
    def probe_interval(self) -> int:
        """Blocks between probes now."""
        return self.schedule.interval

    @property
    def probing(self) -> bool:
        return self.schedule.due(self.block)

    def use_slim(self) -> bool:
        """Whether the next block runs the slim tier."""
        if self.probing and not self.slim_on and not self.probed_blocks and not self._slim_could_win():
            self._back_off()  # probing a slim tier that cannot win even at best would only cost time
        return not self.slim_on if self.probing else self.slim_on

    def probes_in_shadow(self) -> bool:
        """Whether the block ``use_slim`` just granted the slim tier is a shadow probe: the full model decides it."""
        return self.shadow_probes and self.probing and not self.slim_on

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

    def verdict(self) -> str:
        """Where the slim tier stands and why, in words: what ``viasd_stats.slim_tier_verdict`` reports."""
        state = "on" if self.slim_on else "off"
        if not self.slim_on and not self._slim_could_win():
            best = self.estimate.best_case_ratio()
            return (f"off: even with no escalation it would cost {best:.2f} of two-tier decoding per token, "
                    f"not below the {1 - self.margin:.2f} a switch needs")
        return f"{state}: {self.estimate.describe()}"

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
        self.schedule.confirmed(self.block)

    def _switch(self) -> None:
        self.slim_on = not self.slim_on
        self.schedule.switched(self.block)
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
    return TierController(slim_on=slim_on, estimate=PricedBlocks(len(mask.kept_layers) / mask.num_layers), shadow_probes=True)


def starts_with_slim_tier(mask: RoutingMask, lossless: bool) -> bool:
    """The choice before anything is measured: the mask's offline prediction in tiered mode; off in
    lossless mode, where a repair adds at most one token per block for a whole slim pass."""
    return not lossless and predicted_to_pay(mask)


def measures_wall_clock(reproducible: bool | None, lossless: bool, do_sample: bool) -> bool:
    """Whether timings steer a call's choices (``ViaSDConfig.reproducible``): the slim tier's (else ``FixedChoice``),
    the draft planner's costs, plain decoding, the attention kernel and the drafter's precision.

    ``None`` lets them only in lossless greedy decoding: there the full model's argmax picks every token, so the
    choices change the speed but not the output.
    """
    if reproducible is None:
        return lossless and not do_sample
    return not reproducible


@dataclass
class FixedChoice:
    """Where timings may not steer (``measures_wall_clock``): the slim tier runs on every block or on none, as a new controller would start.

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

    def probes_in_shadow(self) -> bool:
        return False

    def verdict(self) -> str:
        why = "the mask's offline prediction" if self.slim_on else "lossless mode or the mask's offline prediction"
        return f"{'on' if self.slim_on else 'off'}: fixed for the call by {why} (timings may not steer this call)"

    def observe(self, block: BlockCost) -> None:
        """Nothing measured changes a fixed choice."""
