"""Choosing the slim tier's mask from a ``MaskSet`` while decoding, from what the full model says anyway.

Whenever the full model scores a block the slim tier scored too (a tiered block that escalated,
every lossless block with the slim tier on), the two passes' rows are side by side
(``policies.SlimCheck``): where their top tokens agree is the running mask's agreement with the
full model, measured for free. To compare another mask, the chooser now and then asks the block
policy to run that mask over the same draft just before the full pass ("a probe", like the tier
controller's probes of the slim tier): one routed pass, and no token changes.

A probe gives a paired comparison on the very same rows, so the decision is a sign test on the
rows where exactly one of the two masks agreed with the full model: with ``b`` rows won by the
probed mask and ``c`` by the running one, the probed mask is *clearly* better when
``b − c ≥ max(min_lead, z·√(b + c))`` (under equal agreement ``b − c`` has mean 0 and standard
deviation ``√(b + c)``; ``z = 2.5`` makes a wrong switch on a tie about a 1-in-160 event per
decision). Counts are kept for the whole call, so switching back needs the evidence to turn.

Probes start at the ``first_probe``-th slim block and then come every ``probe_every`` slim blocks,
the alternatives taken in turn; while every alternative is clearly worse, the interval doubles
(up to ``max_probe_every``; ``backoff.ProbeSchedule``). The schedule counts blocks and the tests
count tokens, with no timing anywhere, so a seeded call is reproducible.

What is remembered follows ``ViaSDConfig.tier_switching`` (``memory.mask_chooser``): where the
slim tier's on/off choice is measured and remembered across calls (``"measured"``), so is the
evidence and the mask chosen, in ``model.viasd_tier_memory``: one short call rarely has enough
blocks verified by the full model to tell masks apart. Elsewhere (``"fixed"``, the default for
tiered decoding) every call starts afresh from the set's default, so its output never depends on
earlier calls.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn
from transformers import LogitsProcessorList

from viasd_hf.control.backoff import ProbeSchedule
from viasd_hf.engine.policies import BlockResult, Tiers
from viasd_hf.engine.verifier import Verifier
from viasd_hf.masks.mask_set import MaskSet
from viasd_hf.vocabulary.head import SubsetHead


@dataclass
class MaskRecord:
    """What one mask did in this call: rows it was compared on with the full model, and its blocks as the slim tier."""

    agreed: int = 0
    compared: int = 0
    slim_blocks: int = 0
    escalated_blocks: int = 0
    probes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "agreement": self.agreed / self.compared if self.compared else None,
            "agreed_rows": self.agreed,
            "compared_rows": self.compared,
            "slim_blocks": self.slim_blocks,
            "escalated_blocks": self.escalated_blocks,
            "escalation_rate": self.escalated_blocks / self.slim_blocks if self.slim_blocks else None,
            "probes": self.probes,
        }


@dataclass
class MaskChooser:
    """The evidence and the choice, which may outlive a call: the running mask, when to probe which other, and the
    paired counts. Concurrent calls on one model may share it, so it takes a lock."""

    names: list[str]
    running: str
    first_probe: int = 2
    probe_every: int = 4
    max_probe_every: int = 64
    z: float = 2.5
    min_lead: int = 4
    lead: dict[tuple[str, str], int] = field(default_factory=dict)  # (a, b): rows a won over b minus rows b won
    discordant: dict[tuple[str, str], int] = field(default_factory=dict)  # rows exactly one of a, b agreed
    switches: list[dict[str, Any]] = field(default_factory=list)
    slim_blocks: int = 0
    turn: int = 0  # which alternative is probed next
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    schedule: ProbeSchedule = field(init=False)  # counts slim blocks

    def __post_init__(self) -> None:
        self.schedule = ProbeSchedule(first=self.first_probe, every=self.probe_every, longest=self.max_probe_every)

    @property
    def probe_interval(self) -> int:
        """Slim blocks between probes now."""
        return self.schedule.interval

    @property
    def alternatives(self) -> list[str]:
        return [name for name in self.names if name != self.running]

    def plan(self) -> tuple[str, str | None]:
        """The mask to run for the next block, and the one to probe if a probe is due."""
        with self.lock:
            due = self.schedule.due(self.slim_blocks)
            return self.running, self.alternatives[self.turn % len(self.alternatives)] if due else None

    def observe(self, name: str, running: list[bool] | None, probed: str | None, other: list[bool] | None) -> None:
        """A slim block run with ``name``: its agreement row by row (``None``: not checked), and ``probed``'s on the
        same rows when it was probed. A block planned before another call switched masks counts, but decides nothing."""
        with self.lock:
            self.slim_blocks += 1
            if running is None or probed is None or other is None or name != self.running or probed == name:
                return
            self.turn += 1
            wins = sum(b and not a for a, b in zip(running, other))
            losses = sum(a and not b for a, b in zip(running, other))
            self._add(probed, self.running, wins - losses, wins + losses)
            self._decide(probed)

    def _add(self, a: str, b: str, lead: int, discordant: int) -> None:
        self.lead[(a, b)] = self.lead.get((a, b), 0) + lead
        self.lead[(b, a)] = -self.lead[(a, b)]
        self.discordant[(a, b)] = self.discordant[(b, a)] = self.discordant.get((a, b), 0) + discordant

    def clearly_better(self, a: str, b: str) -> bool:
        """Whether ``a`` agreed with the full model clearly more often than ``b`` on the rows both were probed on."""
        lead, discordant = self.lead.get((a, b), 0), self.discordant.get((a, b), 0)
        return lead >= max(self.min_lead, self.z * math.sqrt(discordant))

    def _decide(self, probed: str) -> None:
        if self.clearly_better(probed, self.running):
            self.switches.append({"block": self.slim_blocks, "from": self.running, "to": probed,
                                  "reason": self.reason(probed, self.running)})
            self.running = probed
            self.schedule.switched(self.slim_blocks)
        elif all(self.clearly_better(self.running, other) for other in self.alternatives):
            self.schedule.confirmed(self.slim_blocks)
        else:
            self.schedule.undecided(self.slim_blocks)

    def reason(self, a: str, b: str) -> str:
        lead, discordant = self.lead[(a, b)], self.discordant[(a, b)]
        wins = (discordant + lead) // 2
        return (
            f"on the rows both were compared on, {a!r} agreed with the full model where {b!r} did not {wins} times, "
            f"and the reverse {discordant - wins} times: a lead of {lead} >= max({self.min_lead}, "
            f"{self.z}·√{discordant} = {self.z * math.sqrt(discordant):.1f})"
        )


@dataclass
class MaskChoice:
    """One call's side of the choice: the set's verifiers (with this call's logits processors), what each mask did in
    this call, and the chooser deciding (new, or remembered from earlier calls)."""

    verifiers: dict[str, Verifier]
    chooser: MaskChooser
    records: dict[str, MaskRecord] = field(default_factory=dict)
    probe_seconds: float = 0.0
    planned: tuple[str, str | None] = ("", None)

    def __post_init__(self) -> None:
        self.records = {name: MaskRecord() for name in self.verifiers}
        self.started_with = self.chooser.running
        self.first_switch = len(self.chooser.switches)

    @classmethod
    def for_set(
        cls,
        masks: MaskSet,
        model: nn.Module,
        logits_processor: LogitsProcessorList,
        head: SubsetHead | None,
        chooser: MaskChooser,
    ) -> MaskChoice:
        verifiers = {name: Verifier(model, mask, logits_processor, head) for name, mask in masks.masks.items()}
        return cls(verifiers, chooser)

    def tiers(self, tiers: Tiers) -> Tiers:
        """The block's tiers: the running mask as the slim tier, and the mask to probe when a probe is due."""
        running, probe = self.chooser.plan()
        self.planned = (running, probe)
        return replace(tiers, slim=self.verifiers[running], probe=self.verifiers[probe] if probe else None)

    def observe(self, block: BlockResult) -> None:
        """Record a finished block: the running mask's block and agreement, and a probe's outcome when there was one."""
        if not block.passes["slim"]:
            return
        running, probed = self.planned
        record = self.records[running]
        record.slim_blocks += 1
        record.escalated_blocks += int(block.escalated)
        check = block.check
        agrees = check.agrees() if check is not None else None
        other = check.agrees(check.probe) if check is not None and check.probe is not None else None
        if agrees is not None:
            _count(record, agrees)
        if other is not None:
            self.probe_seconds += check.probe.seconds
            self.records[probed].probes += 1
            _count(self.records[probed], other)
        self.chooser.observe(running, agrees, probed if other is not None else None, other)

    def report(self) -> dict[str, Any]:
        """What ``viasd_stats.mask_choice`` shows: the mask chosen and why, and every mask's agreement and escalations
        in this call (``started_with`` is the set's default, or what earlier calls chose when that is remembered)."""
        switches = self.chooser.switches[self.first_switch :]
        if switches:
            reason = switches[-1]["reason"]
        elif not any(record.probes for record in self.records.values()):
            reason = "kept the mask it started with: no alternative was probed (probes wait for blocks the full model verifies)"
        else:
            reason = "kept the mask it started with: no alternative agreed with the full model clearly more often"
        return {
            "default": self.chooser.names[0],
            "started_with": self.started_with,
            "chosen": self.chooser.running,
            "reason": reason,
            "switches": switches,
            "masks": {name: record.to_dict() for name, record in self.records.items()},
            "probe_seconds": self.probe_seconds,
        }


def _count(record: MaskRecord, rows: list[bool]) -> None:
    record.agreed += sum(rows)
    record.compared += len(rows)
