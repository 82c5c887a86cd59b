"""What a verifying pass says about one row's draft (``TierLogits``): the target, in full (the full model) or routed
(the slim verifier), over the row's committed tokens its cache lacks, then the draft; each draft position and one
beyond, raw and processed as ``generate`` processes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from viasd_hf.engine.decisions import allowed_unscaled


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
    fed: int = 0  # tokens the pass ran over: the unprocessed committed ones and the draft

    @cached_property
    def unscaled(self) -> torch.Tensor:
        return allowed_unscaled(self.logits, self.scores)

    @cached_property
    def probs(self) -> torch.Tensor:
        return self.scores.softmax(-1)

