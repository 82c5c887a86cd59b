"""The drafter protocol: what the decode loop asks of anything that proposes tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from viasd_hf.engine.accept import Draft
from viasd_hf.engine.sampling import RandomStream

KeepDrafting = Callable[[list[float]], bool]  # the confidences of the tokens drafted so far -> draft another?


class Drafter(Protocol):
    name: str

    def draft(
        self, ids: torch.Tensor, max_tokens: int, rng: RandomStream | None, keep_drafting: KeepDrafting | None = None
    ) -> Draft:
        """Up to ``max_tokens`` tokens after ``ids``; a sampling drafter draws them from ``rng`` (``None`` when greedy).

        A model drafter asks ``keep_drafting`` before each token (``draft_planner.DraftPlanner``);
        without it, it stops after a token below its confidence threshold, as HF assisted generation.
        """

    def commit(self, ids: torch.Tensor) -> None:
        """``ids`` are now committed: forget whatever the drafter processed that is not on them."""

    def prefill(self, ids: torch.Tensor) -> int:
        """Process the prompt ``ids`` before the first block and return the passes that took. A model drafter keeps
        the logits after the prompt for its first draft token, as HF's assistant does; every drafting pass is
        then a short one, priced alike by the draft planner and the tier controller."""


def through_first_end(tokens: list[int], end_tokens: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first of ``end_tokens``."""
    for i, token in enumerate(tokens):
        if token in end_tokens:
            return tokens[: i + 1]
    return tokens
