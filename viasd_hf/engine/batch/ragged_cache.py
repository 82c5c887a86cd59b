"""One rectangular KV cache per model for a whole batch, each row ragged inside it.

The scheme:

- **One cache, one mask.** Each model (the target; the assistant drafter) has one ``DynamicCache``
  whose layers hold ``[rows, heads, columns, dim]``, and a 2D mask ``[rows, columns]``: 1 where the
  column holds a token of that row's sequence, 0 where it holds nothing of it (a *hole*): the row's
  left padding, a draft it rejected, or a column it did not need in a pass (rows feed different
  numbers of tokens, so a pass's feed is right-padded per row).
- **Positions from the mask.** A token's position id is the number of its row's tokens before it
  (``cumsum − 1``), so holes shift nothing: to the model each row is one contiguous sequence, as in
  ``generate``'s batched decoding of left-padded prompts.
- **Sliding windows by position.** For a model with sliding-window layers every layer of the cache is a
  plain ``DynamicLayer`` (nothing is evicted) and the attention masks are computed from positions, not
  columns (``position_masks``): a hole between two of a row's tokens would otherwise count towards the
  window. A model of full-attention layers only gets transformers' masks from the 2D mask, as ``generate``'s.
- **Ragged acceptance.** After a pass each row keeps its own number of the tokens it fed
  (``forget_last``): the rest become holes, and columns no row holds any more are cropped off the end.
- **Compaction.** When the columns a compaction would free (all columns but the longest row's
  token count) pass ``COMPACT_SHARE`` of the cache, every layer is gathered so that each row's tokens
  are contiguous and right-aligned: left-padded again, without holes.
- **Rows leave.** A finished row is index-selected out of every layer and the mask (``select``).
- **One row** (a single prompt) never holds a hole: what it rejects is the end of the cache, cropped off. So it runs
  in the model's own cache and masks, as ``generate``'s sequence does (sliding, chunked and shared layers, encoder-
  decoder models), with no mask at all unless its prompt is padded.

Why this scheme: transformers builds attention masks from any 2D key mask (``masking_utils``: causal
by column, padding by the mask), so a hole costs only its column, with no kernel of our own; a window
counted in tokens is one more term of a mask built by position, which transformers takes ready-made. The
alternative, moving every row's keys and values into place after each block, copies the whole
cache every block; a block leaves at most a draft's length of holes per row, so holes pile up
slowly and an occasional compaction (one copy of the cache) is far cheaper. Keeping every column of a
sliding layer costs memory a ``DynamicSlidingWindowLayer`` would free, but eviction goes by columns, and
a row's window, measured in its own tokens, spans more columns the more holes it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import Cache, DynamicCache, PretrainedConfig

from viasd_hf.engine.batch.position_masks import SlidingWindows, beside_masks
from viasd_hf.engine.kv_cache import crop_to, full_attention_only, new_cache, self_attention_layers
from viasd_hf.vocabulary.head import SubsetHead

COMPACT_SHARE = 0.25  # compact once the columns a compaction frees pass this share of the cache
COMPACT_AT_LEAST = 16  # ... and at least this many: below it a gather of every layer costs more than it saves
HOLE_TOKEN = 0  # fed in the columns a row does not need in a pass; masked out, so any token id would do
# what one more pass costs beyond the columns it computes, in columns: a pass over few tokens reads every weight once,
# as a pass over about this many does (from 64 on a CPU that computes bf16 slowly to a few hundred with AMX)
PASS_OVERHEAD_TOKENS = 128


class RaggedCache:
    """A model's KV cache for a batch: ``mask[r, c]`` says whether column ``c`` holds a token of row ``r``."""

    def __init__(self, config: PretrainedConfig, rows: int, device: torch.device, prepared: Cache | None = None,
                 encoder: dict[str, Any] | None = None) -> None:
        # one row never holds a hole (its rejected drafts are cropped off the end), so the model masks it as it masks
        # generate's sequence: in its own cache (``generate``'s when it ``prepared`` one), sliding layers included
        self.contiguous = rows == 1
        self.windows = None if self.contiguous else SlidingWindows.of(config)  # None: masked by transformers from ``mask``
        self.cache = new_cache(config, prepared if self.contiguous else None) if self.windows is None else DynamicCache()
        self.encoder = encoder  # an encoder-decoder model's encoder output and mask, fed with every pass
        self.mask = torch.zeros((rows, 0), dtype=torch.long, device=device)
        self.compactions = 0

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def lengths(self) -> torch.Tensor:
        """The tokens each row holds."""
        return self.mask.sum(-1)

    def hole_share(self) -> float:
        """The share of the cache's cells that hold nothing (left padding included)."""
        return 1.0 - float(self.mask.float().mean()) if self.columns else 0.0

    def layout(self, real: torch.Tensor, model: nn.Module,
               stands_in: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """For a pass of ``model`` feeding ``real.shape[1]`` columns (``real``: which of them hold a token of the row)
        after the cache's columns: the cache's mask once it holds them, and the pass's attention mask and position
        ids (none for one row without padding, as ``generate`` feeds a sequence). With ``stands_in``, some columns
        are alternatives to others, fed beside a draft (``position_masks.beside_masks``): each takes the position of
        the column it stands in for and sees what that column sees."""
        mask = torch.cat([self.mask, real.long()], dim=-1)
        if stands_in is not None:
            positions = torch.cat([self.mask.cumsum(-1) - 1, self.lengths()[:, None] + stands_in], dim=-1)
            attention = beside_masks(self.mask, real, stands_in, positions, model)
            return mask, {"attention_mask": attention, "position_ids": positions[:, self.columns :]}
        if self.contiguous and bool(mask.all()):
            return mask, {}
        positions = mask.cumsum(-1) - 1  # a hole: its row's last position before it; −1 before the row's first token
        attention = mask if self.windows is None else self.windows.masks(mask, positions, real.shape[1], model)
        return mask, {"attention_mask": attention, "position_ids": positions[:, self.columns :].clamp(min=0)}

    def run(self, model: nn.Module, tokens: torch.Tensor, real: torch.Tensor, keep: int,
            stands_in: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[rows, keep, vocab]`` of the last ``keep`` columns of ``tokens`` ``[rows, width]``, fed after the
        cache's columns (``stands_in``: alternatives among them, as ``layout`` takes them); the new columns stay in the
        cache, holding the tokens ``real`` marks."""
        mask, layout = self.layout(real, model, stands_in)
        if self.encoder is not None:  # one row (encoder-decoder models decode one prompt at a time), never padded
            output = model(decoder_input_ids=tokens, cache=self.cache, use_cache=True, **self.encoder)
            logits = output.logits[:, -keep:]
        else:
            logits = model(tokens, cache=self.cache, use_cache=True, logits_to_keep=keep, **layout).logits
        self.mask = mask
        return logits

    def newest(self, model: nn.Module, tokens: torch.Tensor, real: torch.Tensor,
               head: SubsetHead | None = None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of each row's newest real column of ``tokens``, fed as ``run`` feeds them (a
        drafting pass, or a drafter's read of the prompts). Each row's tokens are fed in the pass's last columns (its
        holes first, ``flushed_right``), so every row's newest token is in the last column and the LM head runs for
        that column alone: over a read of long prompts the head, a quarter of a small drafter's weights, would
        otherwise run for every column. With ``head`` (a draft vocabulary) it runs for the vocabulary's rows only,
        −inf elsewhere."""
        tokens, real = flushed_right(tokens, real)
        if head is None:
            return self.run(model, tokens, real, keep=1)[:, -1]
        mask, layout = self.layout(real, model)
        logits = _last_column(model, tokens, self.cache, head, **layout)
        self.mask = mask
        return logits

    def reads_apart(self, lengths: list[int]) -> bool:
        """Whether feeding rows of ``lengths`` into this empty cache costs less row by row (``read``, ``newest_apart``)
        than in one pass: where the pass would compute more padding columns than the extra passes cost, each priced at
        ``PASS_OVERHEAD_TOKENS`` columns. Needs plain layers, which keep every column a row was read into."""
        if self.columns or self.contiguous or self.encoder is not None or not full_attention_only(self.cache):
            return False
        if min(lengths, default=0) < 1:
            return False
        padding = len(lengths) * max(lengths) - sum(lengths)
        return padding >= (len(lengths) - 1) * PASS_OVERHEAD_TOKENS

    def read(self, model: nn.Module, tokens: torch.Tensor, real: torch.Tensor, keep: int) -> tuple[torch.Tensor, int]:
        """A first pass into this empty cache (the target reading the prompts), as ``run`` gives it, and the columns
        it computed: one row a pass where that costs less (``reads_apart``), the logits of each row's real columns among
        the last ``keep`` where ``run`` puts them (zeros in its holes). A batch of prompts of very different lengths,
        read in one pass, computes every row to the longest's length, as batched ``generate`` does."""
        lengths = real.sum(-1).tolist()
        if not self.reads_apart(lengths):
            return self.run(model, tokens, real, keep), real.numel()
        kept = real[:, -keep:]
        counts = kept.sum(-1).tolist()

        def last_columns(row: int, ids: torch.Tensor, part: Cache) -> torch.Tensor:
            logits = model(ids, cache=part, use_cache=True, logits_to_keep=max(counts[row], 1)).logits[0]
            return logits[logits.shape[0] - counts[row] :]

        rows = self._read_apart([feed[fed].tolist() for feed, fed in zip(tokens, real)], last_columns)
        logits = rows[0].new_zeros((len(rows), keep, rows[0].shape[-1]))
        for row, (columns, row_logits) in enumerate(zip(kept, rows)):
            logits[row, columns] = row_logits
        return logits, sum(lengths)

    def newest_apart(self, models: list[nn.Module], feeds: list[list[int]],
                     head: SubsetHead | None = None) -> torch.Tensor:
        """What ``newest`` gives for ``feeds`` into this empty cache, each row read by a pass of its own (of
        ``models[r]``): a drafter's read of prompts of very different lengths, which one pass would pad to the
        longest."""
        return torch.cat(self._read_apart(feeds, lambda row, ids, part: _last_column(models[row], ids, part, head)))

    def _read_apart(self, feeds: list[list[int]],
                    read_row: Callable[[int, torch.Tensor, Cache], torch.Tensor]) -> list[torch.Tensor]:
        """What ``read_row(r, tokens, cache)`` gives for each row ``r`` of ``feeds``, read into a cache of its own;
        the rows are then laid out in this empty cache left-padded, as ``compact`` leaves them."""
        outputs, parts = [], []
        for row, feed in enumerate(feeds):
            part = DynamicCache()
            outputs.append(read_row(row, torch.tensor([feed], dtype=torch.long, device=self.mask.device), part))
            parts.append(part)
        longest = max(len(feed) for feed in feeds)
        for index in range(len(parts[0].layers)):
            keys = [part.layers[index].keys for part in parts]
            values = [part.layers[index].values for part in parts]
            self.cache.update(_left_padded(keys, longest), _left_padded(values, longest), index)
        self.mask = _left_aligned(torch.tensor([len(feed) for feed in feeds], device=self.mask.device), longest)
        return outputs

    @contextmanager
    def provisional(self) -> Iterator[None]:
        """Passes inside leave nothing behind: the cache and mask are as before on exit (the slim verifier's pass)."""
        columns, mask = self.columns, self.mask
        try:
            yield
        finally:
            crop_to(self.cache, columns)
            self.mask = mask

    def move(self, rows: list[int], sources: list[int], targets: list[int]) -> None:
        """Row ``rows[i]``'s column ``sources[i]`` replaces its column ``targets[i]`` in every layer (an alternative
        the full model kept, fed beside the draft, takes the place of the draft it replaced). Needs plain layers
        (``kv_cache.full_attention_only``), which hold every column fed."""
        if not rows:
            return
        row, source, target = (torch.tensor(values, device=self.mask.device) for values in (rows, sources, targets))
        for layer in self_attention_layers(self.cache):
            layer.keys[row, :, target] = layer.keys[row, :, source]
            layer.values[row, :, target] = layer.values[row, :, source]

    def forget_last(self, counts: torch.Tensor) -> None:
        """Row ``r``'s last ``counts[r]`` tokens become holes (rejected drafts); columns no row holds are cropped."""
        if bool(counts.any()):
            from_here_on = self.mask.flip(-1).cumsum(-1).flip(-1)  # the row's tokens in this column and after it
            forgotten = (self.mask == 1) & (from_here_on <= counts[:, None])
            self.mask = self.mask.masked_fill(forgotten, 0)
        self.crop_empty_end()

    def crop_empty_end(self) -> None:
        """Drop the columns at the end that no row holds a token in."""
        held = self.mask.any(0).nonzero()
        end = int(held[-1]) + 1 if held.numel() else 0
        if end < self.columns:
            crop_to(self.cache, end)
            self.mask = self.mask[:, :end]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (the rows still decoding), in that order."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.crop_empty_end()

    def compact_if_worth_it(self) -> bool:
        """Compact when it frees ``COMPACT_SHARE`` of the columns (and ``COMPACT_AT_LEAST``); whether it did."""
        if self.contiguous:
            return False  # one row: nothing to gather but its left padding, and sliding layers keep no columns
        freed = self.columns - int(self.lengths().max()) if self.columns else 0
        if freed < max(COMPACT_AT_LEAST, COMPACT_SHARE * self.columns):
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Gather each row's tokens, in order, into the last columns: the cache is left-padded again, without holes."""
        lengths = self.lengths()
        longest = int(lengths.max())
        holes_first = torch.argsort(self.mask, dim=-1, stable=True)  # each row: its holes, then its tokens, in order
        index = holes_first[:, self.columns - longest :]
        for layer in self_attention_layers(self.cache):
            if layer.get_seq_length():
                layer.keys = _gathered(layer.keys, index)
                layer.values = _gathered(layer.values, index)
        self.mask = _left_aligned(lengths, longest)
        self.compactions += 1


def _gathered(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``states`` ``[rows, heads, columns, dim]`` at each row's ``index`` columns."""
    return states.gather(2, index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1]))


def _last_column(model: nn.Module, tokens: torch.Tensor, cache: Cache, head: SubsetHead | None,
                 **inputs: Any) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of the last column of ``tokens`` fed after ``cache``, the LM head run for that column
    alone (over ``head``'s vocabulary where there is one, −inf elsewhere)."""
    if head is None:
        return model(tokens, cache=cache, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]
    return head.spread(head.hidden(model, tokens, cache, **inputs)[:, -1])


def _left_aligned(lengths: torch.Tensor, columns: int) -> torch.Tensor:
    """The mask of rows of ``lengths`` tokens each in the last of ``columns`` columns: a left-padded cache's."""
    return (torch.arange(columns, device=lengths.device)[None, :] >= columns - lengths[:, None]).long()


def _left_padded(states: list[torch.Tensor], columns: int) -> torch.Tensor:
    """One row's ``[1, heads, length, dim]`` keys or values each, as ``[rows, heads, columns, dim]`` with each row in
    the last columns (zeros before: masked)."""
    return torch.cat([torch.nn.functional.pad(state, (0, 0, columns - state.shape[2], 0)) for state in states])


def flushed_right(tokens: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded feed (``right_padded``) with each row's tokens moved, in order, to its last columns and its holes
    to its first: the same tokens for the cache, whose positions come from the mask, with every row's newest token
    in the last column."""
    width = real.shape[1]
    holes = width - real.sum(-1)
    index = (torch.arange(width, device=real.device)[None, :] - holes[:, None]) % max(width, 1)
    return tokens.gather(1, index), real.gather(1, index)


def right_padded(feeds: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one ``[rows, longest]`` tensor of token ids and the mask of the real ones (no
    columns where every row is empty)."""
    width = max((len(feed) for feed in feeds), default=0)
    tokens = torch.full((len(feeds), width), HOLE_TOKEN, dtype=torch.long, device=device)
    real = torch.zeros((len(feeds), width), dtype=torch.bool, device=device)
    for row, feed in enumerate(feeds):
        tokens[row, : len(feed)] = torch.tensor(feed, dtype=torch.long, device=device)
        real[row, : len(feed)] = True
    return tokens, real
