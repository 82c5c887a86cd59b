"""Hybrid drafting's cost model: whether a block that could copy (prompt lookup found a match) should.

Copying is free and, where text repeats (code edits, summaries, RAG), long and mostly kept; but a
match is not always worth a verifying pass. In maths, say, numbers recur and a copied draft is
often thrown away whole, where the model drafter would have had a few tokens kept. So each kind
of block is judged by what it committed per unit of cost:

- a copied block costs one verifying pass;
- a model-drafted block costs that pass plus ``k`` drafter passes of ``drafter_cost`` each (in
  verifying passes, from the bytes each pass reads: ``draft_planner.StaticCosts``).

Tokens per unit of cost is a ratio of faded sums over the blocks of each kind, as throughput
must be (``faded.FadedMean``). It is counted in committed tokens and weight bytes, never
in seconds, so the choice, like the output, is the same on every run. Neither kind is trusted
before it is seen: both start from the same prior, a model-drafted block's, and copying wins the
tie, being free to try; so the first copy decides, and a prompt whose matches are wrong (a
translation, an answer that only reuses a few words) pays for one wasted copy, not for the
several a trusting prior takes to unlearn. The kind that loses is still tried now and then on a
block that could copy, so a change of text is noticed: after ``explore_every`` such blocks, then
after twice as many each time (up to ``max_explore_every``) while the winner stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from viasd_hf.control.backoff import ProbeSchedule
from viasd_hf.control.faded import FadedMean


@dataclass
class CopyOrDraft:
    """Copy where copied blocks commit more per unit of cost than model-drafted ones (see the module docstring)."""

    drafter_cost: float
    decay: float = 0.9
    explore_every: int = 8
    max_explore_every: int = 64
    prior_tokens: float = 2.0  # per block, for both kinds
    prior_drafts: float = 2.0  # drafter passes per block, for both kinds: a copy is not presumed cheaper until seen
    prior_weight: float = 2.0
    copied: FadedMean = field(init=False)  # tokens per unit of cost, from a prior worth ``prior_weight`` blocks
    drafted: FadedMean = field(init=False)
    copy_winning: bool = True
    could_copy: int = 0  # blocks so far for which prompt lookup found a match
    schedule: ProbeSchedule = field(init=False)  # tries of the losing kind, counting blocks that could copy

    def __post_init__(self) -> None:
        weight, cost = self.prior_weight, 1 + self.prior_drafts * self.drafter_cost
        self.copied = FadedMean(self.prior_tokens * weight, cost * weight)
        self.drafted = FadedMean(self.prior_tokens * weight, cost * weight)
        self.schedule = ProbeSchedule(first=self.explore_every, every=self.explore_every, longest=self.max_explore_every)

    def copy(self) -> bool:
        """Whether this block, for which prompt lookup found a match, is drafted by copying."""
        copy_wins = self.copied.mean() >= self.drafted.mean()
        if copy_wins != self.copy_winning:  # a new winner: try the other kind soon again, counting this block
            self.copy_winning = copy_wins
            self.schedule.switched(self.could_copy)
        self.could_copy += 1
        if not self.schedule.due(self.could_copy):
            return copy_wins
        self.schedule.confirmed(self.could_copy)  # a try is one block, decided now: the next waits twice as long
        return not copy_wins

    def observe(self, copied: bool, committed: int, drafter_passes: int) -> None:
        """A block was committed: ``committed`` tokens, drafted by copying or by ``drafter_passes`` model passes."""
        if copied:
            self.copied.observe(committed, self.decay, weight=1.0)
        else:
            self.drafted.observe(committed, self.decay, weight=1.0 + drafter_passes * self.drafter_cost)
