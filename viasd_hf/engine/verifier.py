"""``Verifier``: the target scoring a block in one pass, in full (the full model) or routed (the slim verifier).

Both run over every committed token the full model has not processed yet, then the draft, and
return what they make of each draft position and one beyond (``TierLogits``). The slim
verifier's pass is provisional: its cache writes are cropped at once, so the cache invariant
(``state.TargetCache``) holds after it. The full model's writes stay until the policy has decided
how many drafts to keep (``TargetCache.keep``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers import LogitsProcessorList

from viasd_hf.engine.branching import RunnerUp, leaf_inputs
from viasd_hf.engine.decisions import allowed_unscaled, forbidden
from viasd_hf.engine.state import DecodingState
from viasd_hf.masks.layer_skipping import skipping
from viasd_hf.masks.routing_mask import RoutingMask
from viasd_hf.vocabulary.head import SubsetHead


@dataclass
class TierLogits:
    """What one pass says about each draft position and one beyond, and what the pass took.

    ``logits`` are raw (float32, what ``output_logits`` returns), ``scores`` processed as ``generate``
    processes them (what ``output_scores`` returns and tokens are chosen from), and ``unscaled`` the
    raw probabilities over the tokens the processors allow, which the tier thresholds compare
    (``decisions.allowed_unscaled``): a token the processors forbid has confidence 0 there.
    """

    logits: torch.Tensor
    scores: torch.Tensor
    seconds: float = 0.0
    fed: int = 0  # tokens the pass ran over: the unprocessed committed ones and the draft (and a leaf)
    leaf: TierLogits | None = None  # the row after the drafter's runner-up, when the pass verified one

    @cached_property
    def unscaled(self) -> torch.Tensor:
        return allowed_unscaled(self.logits, self.scores)

    @cached_property
    def probs(self) -> torch.Tensor:
        return self.scores.softmax(-1)

    @property
    def every_row_has_a_choice(self) -> bool:
        """Whether the processors leave the pass some token at every position (a pass over a draft vocabulary
        may have none left where they allow only tokens outside it: it cannot vouch for that block)."""
        return not bool(forbidden(self.scores).all(-1).any())


class Verifier:
    """The target model under ``mask`` (``None``: in full), scoring blocks on the shared cache.

    With ``head`` (the slim verifier with a draft vocabulary) only the vocabulary's rows of the LM
    head run: its scores are −inf elsewhere, so its confidence in a draft outside the vocabulary is 0
    (the draft is escalated, never committed on its authority) and its own tokens come from the vocabulary.
    """

    def __init__(
        self,
        model: nn.Module,
        mask: RoutingMask | None,
        logits_processor: LogitsProcessorList,
        head: SubsetHead | None = None,
    ) -> None:
        self.model = model
        self.mask = mask
        self.skipped = mask.skipped_layers if mask is not None else None  # validated when the call began
        self.logits_processor = logits_processor
        self.head = head

    @property
    def routed(self) -> bool:
        return self.skipped is not None

    def score(self, state: DecodingState, draft: list[int], runner_up: RunnerUp | None = None) -> TierLogits:
        """Run over the unprocessed committed tokens and ``draft``; the LM head runs on the draft positions and one beyond.

        With ``runner_up`` (the full model only) the pass also scores that token as a leaf standing in for
        ``draft[runner_up.position]`` (``branching``): its row is ``leaf``."""
        if runner_up is not None and self.routed:
            raise ValueError("only the full model verifies a runner-up: a routed pass's leaf row would not be its own")
        started = time.perf_counter()
        cache = state.target_cache
        feed = torch.cat([state.unprocessed, state.ids.new_tensor([draft])], dim=-1)
        keep = len(draft) + 1
        if self.routed:
            with cache.provisional(), skipping(self.model, self.skipped):
                logits = cache.run(self.model, feed, cache.length, keep, self.head)
        elif runner_up is not None:
            leaf_at = state.unprocessed.shape[1] + runner_up.position
            feed = torch.cat([feed, feed.new_tensor([[runner_up.token]])], dim=-1)
            layout = leaf_inputs(self.model, cache.length, feed.shape[1], leaf_at, feed.device)
            logits = cache.run(self.model, feed, cache.length, keep + 1, layout=layout)
        else:
            logits = cache.run(self.model, feed, cache.length, keep, self.head)
        leaf = None
        if runner_up is not None:
            logits, leaf_logits = logits[:keep], logits[keep:].float()
            branch = torch.cat([state.ids, state.ids.new_tensor([draft[: runner_up.position] + [runner_up.token]])], dim=-1)
            leaf = TierLogits(leaf_logits, self.logits_processor(branch, leaf_logits))
        scores = processed_scores(self.logits_processor, state.ids, draft, logits)
        return TierLogits(logits.float(), scores, seconds=time.perf_counter() - started, fed=feed.shape[1], leaf=leaf)


def processed_scores(
    logits_processor: LogitsProcessorList, ids: torch.Tensor, draft: list[int], logits: torch.Tensor
) -> torch.Tensor:
    """Each position's scores (``logits``: ``[len(draft) + 1, vocab]``) as ``generate`` would process them after the
    committed ``ids`` (``[1, length]``) and the drafts before it."""
    rows = []
    for i in range(len(draft) + 1):
        prefix = torch.cat([ids, ids.new_tensor([draft[:i]])], dim=-1)
        rows.append(logits_processor(prefix, logits[i : i + 1].float()))
    return torch.cat(rows, dim=0)
