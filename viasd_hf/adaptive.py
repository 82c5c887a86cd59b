"""Online control of the tiers: run the slim tier only while it pays, and size drafts to acceptance.

The slim tier pays when the full passes it saves outweigh its own passes, i.e. when the
escalation rate stays below the slim pass's saving (DESIGN §1) — and whether it does depends on
the machine, the mask and the text. So instead of predicting, the controller measures: seconds
per committed token in blocks with the slim tier and in blocks without it (exponential moving
averages, drafting included), uses the cheaper regime, and now and then probes the other one
so a change of text or load is noticed. Every switch is recorded with its reason.

A probe of the losing regime costs time, so the interval between probes doubles each time a
probe confirms the current choice (up to ``max_probe_every``) and resets on a switch: the
price of staying alert tends to nothing while the choice stays right, which is what "never
slower than plain two-tier decoding" needs when the slim tier does not pay.

Measurements persist across ``generate`` calls on the same model, mask and drafter (as HF keeps
its assistant's confidence threshold), so short generations do not pay the warm-up every time.
The starting choice is the mask's own offline prediction (DIMR's insertion criterion), and a
switch needs a clear margin, so measurement noise does not flip a good choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from torch import nn

from .masks import RoutingMask


@dataclass
class Regime:
    """Measured cost of one regime (slim tier on or off): faded sums of seconds and of committed tokens.

    Their ratio is the regime's throughput. A decayed mean of per-block ratios would not be:
    blocks that commit one token weigh as much as blocks that commit sixteen, which favours
    whichever regime has the steadier block sizes rather than the faster one.
    """

    seconds: float = 0.0
    tokens: float = 0.0
    blocks: int = 0

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None

    def observe(self, seconds: float, tokens: int) -> None:
        self.blocks += 1
        self.seconds += seconds
        self.tokens += tokens

    def fade(self, decay: float) -> None:
        """Age what was measured by one block: the ratio stays, but new blocks outweigh old ones."""
        self.seconds *= decay
        self.tokens *= decay


@dataclass
class TierController:
    """Chooses, block by block, whether the slim tier runs; probes the other choice with a backing-off interval.

    A probe runs the other regime until it has committed ``probe_tokens`` tokens (or for
    ``max_probe_blocks`` blocks): a few blocks of one to sixteen tokens each are too noisy to act
    on, and a wrong switch costs far more than a late one. The decision is taken when the probe
    ends; between probes, the current regime is compared with what the last probe measured.
    """

    slim_on: bool = True  # the starting choice: the offline prediction of the mask, when it has one
    first_probe: int = 8  # the regime the prior did not pick is measured early, once
    probe_every: int = 32  # blocks between probes after a switch; doubles while probes confirm the choice
    max_probe_every: int = 256
    probe_tokens: int = 32
    max_probe_blocks: int = 8
    decay: float = 0.9  # per block, for both regimes: a probe's blocks outweigh what was measured long ago
    margin: float = 0.10  # switch only to a regime that is cheaper by more than this fraction (no flapping on noise)
    on: Regime = field(default_factory=Regime)
    off: Regime = field(default_factory=Regime)
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
        return not self.slim_on if self.probing else self.slim_on

    def observe(self, used_slim: bool, seconds: float, tokens: int) -> None:
        """Record a finished block; at the end of a probe, or whenever the current regime falls clearly
        behind what the other one last measured, switch."""
        probing = self.probing
        self.on.fade(self.decay)
        self.off.fade(self.decay)
        (self.on if used_slim else self.off).observe(seconds, tokens)
        self.block += 1
        if not probing:
            if self._other_is_cheaper():
                self._switch()
            return
        self.probed_blocks += 1
        if used_slim != self.slim_on:  # not a block that paid the current regime's debt
            self.probed_tokens += tokens
        if self.probed_tokens < self.probe_tokens and self.probed_blocks < self.max_probe_blocks:
            return
        self.probed_tokens = self.probed_blocks = 0
        if self._other_is_cheaper():
            self._switch()
        else:
            self._back_off()

    def _other_is_cheaper(self) -> bool:
        current, other = (self.on, self.off) if self.slim_on else (self.off, self.on)
        if current.seconds_per_token is None or other.seconds_per_token is None:
            return False
        return other.seconds_per_token < (1 - self.margin) * current.seconds_per_token

    def _back_off(self) -> None:
        """A probe confirmed the current choice: wait twice as long before the next one."""
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
        self.next_probe = self.block + self.probe_interval

    def _switch(self) -> None:
        self.slim_on = not self.slim_on
        self.probe_interval = self.probe_every
        self.next_probe = self.block + self.probe_interval
        self.switches.append({
            "block": self.block,
            "slim_tier": "on" if self.slim_on else "off",
            "reason": (
                f"{self.on.seconds_per_token * 1000:.1f} ms/token with the slim tier vs "
                f"{self.off.seconds_per_token * 1000:.1f} ms/token without"
            ),
        })


@dataclass
class DraftLength:
    """HF's "heuristic" schedule: grow by 2 after a fully accepted draft, shrink by 1 otherwise."""

    length: int
    maximum: int

    def update(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.length = min(self.maximum, self.length + 2)
        elif drafted:
            self.length = max(1, self.length - 1)


_CONTROLLERS: WeakKeyDictionary[nn.Module, dict[tuple, TierController]] = WeakKeyDictionary()


def predicted_to_pay(mask: RoutingMask) -> bool:
    """Whether the mask's DIMR search predicted the slim tier to pay (insertion criterion Δ > 0 and a
    predicted speed-up above 1); masks without that record are given the benefit of the doubt."""
    delta = mask.metadata.get("insertion", {}).get("delta")
    speedup = mask.metadata.get("predicted_speedup")
    return not ((delta is not None and delta <= 0) or (speedup is not None and speedup < 1))


def controller_for(model: nn.Module, mask: RoutingMask, key: tuple) -> TierController:
    """The controller that has been measuring this model with this mask, drafter and mode (new if none).

    A new controller starts from the mask's offline prediction; measurements then decide.
    """
    per_model = _CONTROLLERS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = TierController(slim_on=predicted_to_pay(mask))
    return per_model[key]
