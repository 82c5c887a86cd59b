"""``ViaSDStats``: what each tier did during one ``generate`` call.

Nothing in transformers reports acceptance statistics; these let a user see whether the slim
tier paid for itself (escalation rate vs its cost) without a profiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from viasd_hf.engine.policies import BlockResult


@dataclass
class ViaSDStats:
    """Counts are tokens unless named ``*_forwards`` or ``*_blocks``.

    With ``adaptive=True``, ``slim_on_blocks`` / ``slim_off_blocks`` say how often the slim tier
    was active, ``slim_shadow_blocks`` how many of the off blocks probed it in shadow (its pass ran,
    the full model decided), ``tier_switches`` when and why the controller switched it, and ``slim_tier_verdict``
    where it stood at the end of the call and why. Where speculation did not pay, ``plain_blocks`` counts
    the blocks decoded one token at a time without a draft, ``speculation_switches`` when and why the
    decoder switched between the two, and ``speculation_verdict`` where it stood at the end (``speculation_switch``).

    ``new_tokens == accepted_tokens + slim_tokens + full_tokens`` unless generation stopped inside
    a block: every committed token was a draft that was accepted (by the slim or the full tier),
    or produced by the slim verifier (regenerated / its bonus token), or produced by the full
    model (correction / bonus). ``committed_by`` splits exactly the committed tokens that way
    (``drafter`` / ``slim`` / ``full``), so it always sums to ``new_tokens``; in lossless mode a
    slim repair the full model kept counts as accepted but is credited to ``slim`` there.
    """

    new_tokens: int = 0
    blocks: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    slim_accepted_tokens: int = 0
    regenerated_tokens: int = 0
    escalated_tokens: int = 0
    escalated_blocks: int = 0
    catch_up_blocks: int = 0
    slim_tokens: int = 0
    full_tokens: int = 0
    slim_committed_tokens: int = 0
    peak_slim_backlog: int = 0
    slim_agreed_rows: int = 0  # rows where the slim tier's top token was the full model's, where both scored them
    slim_compared_rows: int = 0
    committed_by: dict[str, int] = field(default_factory=lambda: {"drafter": 0, "slim": 0, "full": 0})
    slim_on_blocks: int = 0
    slim_off_blocks: int = 0
    slim_shadow_blocks: int = 0
    tier_switches: list[dict] = field(default_factory=list)
    slim_tier_verdict: str | None = None
    second_choices: int = 0  # the drafter's second choices the full model verified beside the draft
    second_choices_kept: int = 0  # ... and kept: the full model's own token, with its next token from the same pass
    plain_blocks: int = 0  # blocks decoded without a draft, one token each: speculation did not pay (``speculation_switch``)
    speculation_switches: list[dict] = field(default_factory=list)
    speculation_verdict: str | None = None
    full_forwards: int = 0
    prefill_forwards: int = 0  # 0 where the first block's full pass carried the prompt (``BatchedDecoder.open``)
    slim_forwards: int = 0
    drafter_forwards: int = 0  # its reads of the prompt included
    drafted_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"drafter": 0.0, "slim": 0.0, "full": 0.0, "total": 0.0})

    def record_prefill(self, seconds: float) -> None:
        self.full_forwards += 1
        self.prefill_forwards += 1
        self.seconds["full"] += seconds

    def record_block(self, block: BlockResult, drafted: int, catch_up: bool) -> None:
        """Everything a block did, from its ``BlockResult`` (``drafted``: the tokens the drafter proposed)."""
        self.blocks += 1
        self.drafted_tokens += drafted
        self.catch_up_blocks += int(catch_up)
        for position in range(block.judged):
            self.record_position(position, position < block.kept)
        self.accepted_tokens += block.kept
        if block.decided_by == "slim":
            self.slim_accepted_tokens += block.kept
            self.slim_tokens += 1
            self.slim_committed_tokens += block.kept + 1
        else:
            self.full_tokens += 1 + int(block.second_choice_kept)
        self.second_choices_kept += int(block.second_choice_kept)
        self.regenerated_tokens += int(block.regenerated)
        self.escalated_blocks += int(block.escalated)
        self.escalated_tokens += int(block.escalated)
        self.slim_forwards += block.passes["slim"]
        self.full_forwards += block.passes["full"]
        for tier in ("slim", "full"):
            self.seconds[tier] += block.seconds[tier]
        if block.check is not None:
            self.slim_agreed_rows += sum(block.check.agrees())
            self.slim_compared_rows += block.check.rows

    def record_draft(self, forwards: int, seconds: float) -> None:
        self.drafter_forwards += forwards
        self.seconds["drafter"] += seconds

    def record_commit(self, made_by: str) -> None:
        self.new_tokens += 1
        self.committed_by[made_by] += 1

    def record_position(self, position: int, accepted: bool) -> None:
        while len(self.drafted_at_position) <= position:
            self.drafted_at_position.append(0)
            self.accepted_at_position.append(0)
        self.drafted_at_position[position] += 1
        self.accepted_at_position[position] += int(accepted)

    @property
    def rejection_rate(self) -> float:
        return 1.0 - self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def escalation_rate(self) -> float:
        """Fraction of slim-verified blocks that the full model had to decide."""
        slim_blocks = self.blocks - self.catch_up_blocks
        return self.escalated_blocks / slim_blocks if slim_blocks and self.slim_forwards else 0.0

    @property
    def slim_agreement(self) -> float | None:
        """How often the slim tier's top token was the full model's, on the rows both scored (escalated tiered
        blocks, lossless blocks with the slim tier on): measured for free, ``None`` when there were none."""
        return self.slim_agreed_rows / self.slim_compared_rows if self.slim_compared_rows else None

    @property
    def decode_full_forwards(self) -> int:
        return self.full_forwards - self.prefill_forwards

    @property
    def mean_accepted_per_full_call(self) -> float:
        """Tokens committed per full-model forward after the prefill (the τ of the SD literature)."""
        return self.new_tokens / self.decode_full_forwards if self.decode_full_forwards else float(self.new_tokens)

    @property
    def full_calls_per_token(self) -> float:
        return self.decode_full_forwards / self.new_tokens if self.new_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_position, self.drafted_at_position)]

    def to_dict(self) -> dict[str, Any]:
        derived = ("rejection_rate", "escalation_rate", "slim_agreement", "mean_accepted_per_full_call",
                   "full_calls_per_token", "acceptance_by_position")
        return asdict(self) | {name: getattr(self, name) for name in derived}

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.blocks} blocks | drafted {self.drafted_tokens}, accepted "
            f"{self.accepted_tokens} ({self.slim_accepted_tokens} by the slim tier), regenerated {self.regenerated_tokens}, "
            f"escalated blocks {self.escalated_blocks} | rejection rate {self.rejection_rate:.1%} | forwards: "
            f"full {self.full_forwards}, slim {self.slim_forwards}, drafter {self.drafter_forwards} | "
            f"{self.mean_accepted_per_full_call:.2f} tokens per full call"
        )
