"""The runner-up branch: a greedy block also verifies the drafter's second choice at its least sure position.

A verify pass over a few tokens costs about what a pass over one does on a memory-bound machine,
so one extra row is nearly free. The drafter's runner-up at position ``j`` rides in the same full
pass as a leaf beside the draft (a two-leaf token tree, as in SpecInfer): it sits at ``j``'s
position and sees the committed prefix and ``draft[:j]`` but none of the draft from ``j`` on.
When the full model rejects ``draft[j]`` in favour of exactly that runner-up, the block keeps
``draft[:j]``, the runner-up and the full model's own token after it: one token more than the
chain alone would commit. Every committed token is still the full model's choice, so greedy output
is unchanged.

The leaf goes where the drafter itself rates it likeliest to be needed:
``P(draft[:j] kept) · P(runner-up) ≈ c_0 ··· c_{j−1} · q_j(runner-up)``, from the drafter's own
probabilities, and only when that chance pays for the row: the draft planner's cost model
(``DraftPlanner.leaf_threshold``) or, without one, ``MIN_CHANCE``.

Supported where a custom 4-D attention mask means what it says: decoder-only models on SDPA or
eager attention, a cache of plain full-attention layers, a prompt without padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from viasd_hf.engine.kv_cache import crop_to, full_attention_only, self_attention_layers

MIN_CHANCE = 0.1  # without a cost model: the least chance that the leaf is the full model's token worth a row
MASK_KINDS = ("sdpa", "eager")


@dataclass(frozen=True)
class RunnerUp:
    """The drafter's second choice ``token`` at draft position ``position``."""

    position: int
    token: int


def runner_up(tokens: list[int], probs: list[torch.Tensor | None], min_chance: float | None = None) -> RunnerUp | None:
    """The runner-up worth a leaf beside draft ``tokens`` (drawn from ``probs``): where
    ``P(drafts before it kept) · q(runner-up)`` is largest, if ≥ ``min_chance`` (default ``MIN_CHANCE``); none for
    a draft not drawn from a model (prompt lookup)."""
    min_chance = MIN_CHANCE if min_chance is None else min_chance
    if any(distribution is None for distribution in probs):
        return None
    best, reach = None, 1.0
    for position, (token, distribution) in enumerate(zip(tokens, probs)):
        top = distribution.topk(2)
        second = int(top.indices[1]) if int(top.indices[0]) == token else int(top.indices[0])
        chance = reach * float(distribution[second])
        if chance >= min_chance and (best is None or chance > best[0]):
            best = (chance, RunnerUp(position, second))
        reach *= float(distribution[token])
    return best[1] if best is not None else None


def can_branch(model: nn.Module, cache: object, padded: bool) -> bool:
    """Whether a leaf's custom attention mask is honoured: decoder-only, SDPA or eager, full-attention layers only."""
    config = model.config
    if padded or getattr(config, "is_encoder_decoder", False) or config._attn_implementation not in MASK_KINDS:
        return False
    return full_attention_only(cache)


def leaf_inputs(model: nn.Module, cached: int, fed: int, leaf_at: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Attention mask and positions for a pass over ``fed`` tokens after ``cached`` ones whose last token is a
    leaf standing in for the fed token at index ``leaf_at``: causal for the others, and the leaf sees only what
    precedes ``leaf_at``, and itself."""
    total = cached + fed
    attends = torch.ones(fed, total, dtype=torch.bool, device=device).tril(diagonal=cached)
    attends[-1, cached + leaf_at : total - 1] = False
    positions = torch.arange(cached, total, device=device)
    positions[-1] = cached + leaf_at
    mask = attends[None, None]
    if model.config._attn_implementation == "eager":
        dtype = model.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return {"attention_mask": mask, "position_ids": positions[None]}


def keep_leaf(cache: object, length: int, leaf_index: int) -> None:
    """The cache after a taken leaf: its first ``length`` entries, then the leaf's own, and nothing else."""
    for layer in self_attention_layers(cache):
        layer.keys[..., length, :] = layer.keys[..., leaf_index, :]
        layer.values[..., length, :] = layer.values[..., leaf_index, :]
    crop_to(cache, length + 1)
