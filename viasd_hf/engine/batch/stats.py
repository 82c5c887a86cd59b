"""``BatchViaSDStats``: what a batched call did, in total and row by row.

The shape: ``viasd_stats`` of a batched call is a ``ViaSDStats`` whose fields hold the totals, with

- ``rows``: one ``ViaSDStats`` per prompt, in the order of the batch ``generate`` was given, counted as
  if that prompt had been decoded alone: the blocks it took part in, the passes that fed it, its
  drafts, its committed tokens. Each satisfies the bookkeeping of a call of one prompt.
- totals: token counts (``new_tokens``, ``committed_by``, drafted / accepted / regenerated tokens, by
  position, slim agreement) are sums over the rows; ``blocks``, every ``*_forwards`` count and
  ``seconds`` count the batch's passes once each. So ``mean_accepted_per_full_call`` is the tokens
  committed per batched full pass, and ``full_forwards`` can be far below ``new_tokens``.
- what only a batch has: ``batch_size``; ``ragged_blocks``, blocks in which rows kept different
  numbers of drafts; ``rows_left``, when each row finished and left the batch; ``compactions`` of
  the target's and the assistant's caches; ``peak_hole_share``, the largest share of the target's
  cache that held nothing (left padding and rejected drafts), measured after each block.
- ``speculation_verdict``: the switch's verdict, or, where the drafter never read the prompts because
  that read would not have paid (``SpeculationSwitch.reading_pays``), why the call decoded plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from viasd_hf.engine.stats import ViaSDStats

SUMMED = ("new_tokens", "drafted_tokens", "accepted_tokens", "slim_accepted_tokens", "regenerated_tokens",
          "escalated_tokens", "escalated_blocks", "slim_tokens", "full_tokens", "slim_committed_tokens",
          "slim_agreed_rows", "slim_compared_rows", "second_choices", "second_choices_kept")


@dataclass
class BatchViaSDStats(ViaSDStats):
    """Totals over the batch in ``ViaSDStats``' fields and one ``ViaSDStats`` per prompt in ``rows`` (see the module
    docstring for which totals are sums over rows and which count batched passes)."""

    batch_size: int = 0
    rows: list[ViaSDStats] = field(default_factory=list)
    ragged_blocks: int = 0
    rows_left: list[dict] = field(default_factory=list)  # {"row": index in the batch, "block": ..., "new_tokens": ...}
    compactions: dict[str, int] = field(default_factory=lambda: {"target": 0, "drafter": 0})
    peak_hole_share: float = 0.0

    def total_rows(self, rows: list[ViaSDStats]) -> None:
        """Fill the token totals from the rows' own stats (in the batch's order)."""
        self.rows = rows
        self.batch_size = len(rows)
        for name in SUMMED:
            setattr(self, name, sum(getattr(row, name) for row in rows))
        self.committed_by = {who: sum(row.committed_by[who] for row in rows) for who in self.committed_by}
        self.peak_slim_backlog = max((row.peak_slim_backlog for row in rows), default=0)
        depth = max((len(row.drafted_at_position) for row in rows), default=0)
        self.drafted_at_position = [sum(row.drafted_at_position[i] for row in rows if i < len(row.drafted_at_position))
                                    for i in range(depth)]
        self.accepted_at_position = [sum(row.accepted_at_position[i] for row in rows if i < len(row.accepted_at_position))
                                     for i in range(depth)]

    def summary(self) -> str:
        """One line per row under the batch's totals; a batch of one is its row's line."""
        if len(self.rows) == 1:
            return self.rows[0].summary()
        lines = [(f"batch of {self.batch_size}: {self.new_tokens} tokens in {self.blocks} blocks, "
                  f"{self.decode_full_forwards} batched full passes ({self.mean_accepted_per_full_call:.2f} tokens each), "
                  f"{self.ragged_blocks} ragged blocks, {self.compactions} compactions")]
        lines += [f"  row {i}: {row.summary()}" for i, row in enumerate(self.rows)]
        return "\n".join(lines)
